"""kvserve-loadtest's command line: help and defaults for every option, readable errors for
bad values, no matplotlib needed unless a PNG is asked for, a git-ignored default output
folder, and a report figure readable at a glance."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.__main__ import MATPLOTLIB_HINT, PNG_DEFAULT, build_parser

ROOT = Path(__file__).resolve().parents[2]
# Runs loadtest's main() with matplotlib made unimportable (a None entry in sys.modules
# makes `import matplotlib` raise ImportError), as on a plain `pip install kvserve`.
WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from loadtest.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


def run_without_matplotlib(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, *args],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_option_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) >= 20
    for action in options:
        assert action.help and len(action.help) > 8, action.option_strings
    text = parser.format_help()
    assert text.count("(default:") == len(options)


def test_help_works_without_matplotlib() -> None:
    result = run_without_matplotlib("--help")
    assert result.returncode == 0, result.stderr
    assert "--concurrency" in result.stdout and "--png" in result.stdout
    assert "ModuleNotFoundError" not in result.stderr


def test_an_explicit_png_without_matplotlib_says_how_to_get_it() -> None:
    # Fails before any request: the URL is never contacted.
    result = run_without_matplotlib("--url", "http://127.0.0.1:9", "--png", "x.png")
    assert result.returncode == 2
    assert "--png needs matplotlib" in result.stderr
    assert MATPLOTLIB_HINT in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-c", "0"], "argument -c/--concurrency: must be an integer >= 1, got '0'"),
        (["--turns", "two"], "argument -t/--turns: must be an integer >= 1, got 'two'"),
        (["--request-rate", "-3"], "argument --request-rate: must be a number > 0, got '-3'"),
        (["--duration", "0"], "argument --duration: must be a number > 0, got '0'"),
        (["--think-time", "-1"], "argument --think-time: must be a number >= 0, got '-1'"),
        (["--temperature", "nan"], "argument --temperature: must be a number >= 0, got 'nan'"),
        (["--user-len", "uniform:64"], "argument --user-len: must be N, uniform:MEAN"),
        (["--url", "localhost:8000"], "argument --url: must start with http:// or https://"),
    ],
)
def test_bad_values_name_the_option_and_the_bound(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_default_output_folder_is_ignored_by_git() -> None:
    parser = build_parser()
    json_default = parser.parse_args([]).json
    assert json_default.parent == PNG_DEFAULT.parent == Path("loadtest-out")
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert f"{PNG_DEFAULT.parent}/" in ignored


def _document() -> dict:
    from loadtest.report import build_result
    from tests.unit.test_loadtest import _run_result

    document = build_result(_run_result(True))
    document["target"]["url"] = "http://10.1.2.3:8123"
    rng = random.Random(0)
    for record in document["requests"]:
        t = 0.3
        record["chunk_times"] = [t := t + rng.lognormvariate(-4.5, 0.8) for _ in range(200)]
    return document


def test_report_figure_is_readable_at_a_glance() -> None:
    pytest.importorskip("matplotlib")
    from loadtest.plot import draw_report

    fig = draw_report(_document())
    title = fig.texts[0].get_text()
    assert "8123" not in title and "10.1.2.3" not in title and "m" in title
    by_title = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert by_title["Inter-token latency"].get_xscale() == "log"
    assert all(ax.get_yscale() == "linear" for ax in fig.axes)  # no symlog anywhere
    (events,) = [ax for title, ax in by_title.items() if title.startswith("Preemptions")]
    twins = [ax for ax in fig.axes if ax is not events and ax.bbox.bounds == events.bbox.bounds]
    assert [ax.get_ylabel() for ax in twins] == ["prefix-cache hit tokens"]
    assert events.get_ylabel() == "preemptions, blocks swapped"
