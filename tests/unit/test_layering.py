"""The scheduler and the KV layer import no torch and no model code (a house rule)."""

from __future__ import annotations

import subprocess
import sys


def test_scheduler_and_kv_layer_import_no_torch_or_model_code() -> None:
    probe = (
        "import sys, engine.scheduler, engine.kv.manager, engine.kv.stats, engine.kv.budget,"
        " engine.kv.block_map;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine.model',"
        " 'engine.runner', 'transformers'))];"
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
