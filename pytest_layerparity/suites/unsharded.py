"""A test that failed with the port sharded over torchrun ranks, run once more unsharded (one
process, ``--tp-degree 1``) by rank 0, so the failure says whether the difference appears only
sharded (how the port splits or joins its weights, KV heads or partial sums) or in the layer
itself."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

from ..distributed.env import rank_info
from ..store.commands import target_flags

if TYPE_CHECKING:
    from ..session import LayerParitySession

#: What torchrun sets in each rank's environment (a re-run without them is a world of one).
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def unsharded_command(session: LayerParitySession, layer: int, keyword: str) -> list[str]:
    """The test's own command, unsharded: the same target, port, model and goldens, one layer."""
    s = session.settings
    port = ["--port", "nxdi", *(["-o", f"layerparity_nxdi_app={s.nxdi_app}"] if s.nxdi_app else [])]
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        *target_flags(s.target_name),
        *port,
        "--tp-degree",
        "1",
        f"--model={session.model.model_dir}",
        f"--golden-dir={session.store.root}",
        "--layers",
        str(layer),
        "-k",
        keyword,
    ]


def unsharded_note(session: LayerParitySession, layer: int, keyword: str) -> str:
    """The failure text's line on the same test unsharded (empty on ranks other than 0, which
    report nothing)."""
    ranks = rank_info()
    if not ranks.reports:
        return ""
    tp = session.settings.tp_degree
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    command = unsharded_command(session, layer, keyword)
    done = subprocess.run(command, cwd=session.rootpath, env=env, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return (
            f"  unsharded (--tp-degree 1, run once more in one process) this test passes: the difference appears "
            f"only sharded over {tp} ranks (how the port splits or joins its weights, KV heads or partial sums)"
        )
    if done.returncode == 1:
        return (
            "  unsharded (--tp-degree 1, run once more in one process) this test fails too: the difference is in "
            "the layer itself, not in how it is sharded"
        )
    return f"  unsharded re-run (--tp-degree 1) did not complete (exit status {done.returncode}): {' '.join(command)}"
