"""Fault injection (issue 7): a golden that is corrupt, stale, partial or hostile never
passes a test, and no run loses earlier results.

Real files, real processes: goldens are damaged on disk, extraction is SIGKILLed halfway
through a write, a full disk is simulated under the store's own write call, two processes
(and two xdist workers) extract into one store at once. Every test asserts the exact
message the user reads.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from support import DEFAULT_GOLDENS, DEFAULT_MODEL

from pytest_layerparity.model.build import config_sha256, read_config_json
from pytest_layerparity.store import golden, tensorfile
from pytest_layerparity.store.golden import GoldenError, GoldenStore

USAGE_ERROR = pytest.ExitCode.USAGE_ERROR  # 4

# Records every layer the plugin builds on the target: a refused golden must build none.
RECORD_BUILDS = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    with open({path!r}, "a") as handle:
        handle.write(f"{{layer_idx}}\\n")
    return None
"""

# SIGKILLs the extraction halfway through writing layer 3: half of its bytes are in the
# temporary file, which is about to be renamed into place.
KILL_AT_LAYER_3 = """
import os, signal

def pytest_configure(config):
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)) == "layer_00003.safetensors":
            with open(src, "r+b") as handle:
                handle.truncate(os.path.getsize(src) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
"""


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def fresh(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester folder pointing the plugin at the default model and an empty store, for the
    layers' prompt goldens alone (what these tests are about: one file per layer)."""
    pytester.makeini(
        f"[pytest]\nlayerparity_model = {DEFAULT_MODEL}\nlayerparity_golden_dir = store\n"
        "layerparity_decode_steps = 0\nlayerparity_logits_topk = 0\n"
    )
    return pytester


@pytest.fixture
def store_copy(tmp_path: Path) -> GoldenStore:
    """A copy of the committed goldens, to damage."""
    shutil.copytree(DEFAULT_GOLDENS, tmp_path / "store")
    return GoldenStore(tmp_path / "store")


def read_manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def write_manifest(root: Path, manifest) -> None:
    (root / "manifest.json").write_text(json.dumps(manifest))


def edit_manifest(root: Path, change) -> None:
    manifest = read_manifest(root)
    change(manifest)
    write_manifest(root, manifest)


def rewrite_entry(root: Path, key: str, file: str, tensors: dict, metadata: dict) -> Path:
    """Replace an entry's file and update its sha256 and size in the manifest, as a
    careless (or hostile) hand would: the manifest then vouches for the new content."""
    payload = save(tensors, metadata={"layerparity": json.dumps(metadata)})
    path = root / file
    path.write_bytes(payload)
    edit_manifest(
        root,
        lambda m: m["files"][key].update({"sha256": golden.hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}),
    )
    return path


def read_entry(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["layerparity"])
    return load_file(str(path)), metadata


def verify_store(root: Path) -> dict:
    """Every entry the manifest lists loads and verifies; returns the manifest."""
    store = GoldenStore(root)
    manifest = store.read_manifest()
    for key, record in manifest["files"].items():
        assert not record["file"].endswith(".tmp") and not record["file"].startswith(".")
        store.load(key)
    return manifest


def temp_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".*.tmp"))


def file_state(path: Path) -> tuple:
    info = path.stat()
    return (info.st_ino, info.st_mtime_ns, path.read_bytes())


def sha16(path: Path) -> str:
    return golden.sha256_file(path)[:16]


def extract_cmd(root: Path, layers: str | None = None, model: Path | None = None, flags: str = "") -> str:
    """The command a message suggests: with --model when the plugin knows the model (a session),
    without when the store is used on its own; ``flags``: the store's extraction settings (the
    projects here: ``PROJECT_FLAGS``)."""
    model_flag = f" --model={model}" if model else ""
    return f"pytest --gpu-golden --extract{model_flag} --golden-dir={root}{flags}" + (
        f" --layers {layers}" if layers else ""
    )


#: The extraction settings the ``project`` and ``fresh`` stores differ from the defaults by.
PROJECT_FLAGS = " --decode-steps 0"


def full_disk_for(name_part: str, written: list[str] | None = None):
    """A stand-in for tensorfile.write_all (every byte the store writes) that writes half of the bytes of files whose
    (temporary) name contains ``name_part`` and then fails as a full disk does."""
    real = tensorfile.write_all

    def write_all(fd: int, data: bytes) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if name_part in os.path.basename(target):
            os.write(fd, data[: len(data) // 2])
            if written is not None:
                written.append(target)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    return write_all


# -- corrupt goldens -----------------------------------------------------------------------


def _truncate(path: Path, root: Path) -> str:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:20])
    return f" (the file is corrupt or was changed: 20 bytes, the manifest says {size})"


def _flip_byte(path: Path, root: Path) -> str:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return " (the file is corrupt or was changed)"


def _other_sha(path: Path, root: Path) -> str:
    edit_manifest(root, lambda m: m["files"]["layer_4"].update({"sha256": "0" * 64}))
    return " (the file is corrupt or was changed)"


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_byte, _other_sha], ids=["truncated", "flipped-byte", "manifest-sha"]
)
def test_corrupt_golden_errors_its_layer_naming_the_file_and_compares_nothing(project, damage):
    """A truncated file, a flipped byte, a sha256 that is not the manifest's: the layer's
    test errors at setup naming the file and the command that regenerates it; the layer is
    never built nor run, and the other layers still pass."""
    goldens = project.path / "goldens"
    path = goldens / "layer_00004.safetensors"
    note = damage(path, goldens)
    built = project.path / "built.txt"
    project.makeconftest(RECORD_BUILDS.format(path=str(built)))
    result = project.runpytest("--target", "cpu", "--layers", "3-4")
    result.assert_outcomes(passed=1, errors=1)
    want = read_manifest(goldens)["files"]["layer_4"]["sha256"]
    assert (
        f"{path}: sha256 {sha16(path)}... does not match the manifest's {want[:16]}...{note}; "
        f"regenerate it with: {extract_cmd(goldens, '4', DEFAULT_MODEL, PROJECT_FLAGS)}"
    ) in result.stdout.str()
    assert built.read_text().split() == ["3"]  # layer 4 was never built, so nothing was compared


def test_the_regenerate_command_repairs_a_corrupt_layer_and_model_io_and_keeps_the_others(project):
    """Running the command the error names rewrites the damaged layer (and a damaged
    model_io) and leaves every other file as it was."""
    goldens = project.path / "goldens"
    _flip_byte(goldens / "layer_00004.safetensors", goldens)
    _flip_byte(goldens / "model_io.safetensors", goldens)
    others = {i: file_state(goldens / f"layer_{i:05d}.safetensors") for i in (0, 1, 2, 3, 5)}
    with pytest.raises(GoldenError, match=r"model_io\.safetensors: sha256"):
        GoldenStore(goldens).load("model_io")
    result = project.runpytest("--gpu-golden", "--extract", f"--golden-dir={goldens}", "--layers", "4")
    result.assert_outcomes(passed=1)
    verify_store(goldens)
    assert {i: file_state(goldens / f"layer_{i:05d}.safetensors") for i in (0, 1, 2, 3, 5)} == others
    project.runpytest("--target", "cpu", "--layers", "4").assert_outcomes(passed=1)


# -- stale stores --------------------------------------------------------------------------


def _stale_cases():
    sha = config_sha256(read_config_json(DEFAULT_MODEL))
    return [
        pytest.param(
            {"model.config_sha256": "0" * 64},
            [],
            f"model.config_sha256: store has '{'0' * 64}', this run has '{sha}'",
            id="other-config",
        ),
        pytest.param({"model.num_layers": 12}, [], "model.num_layers: store has 12, this run has 6", id="layer-count"),
        pytest.param(
            {"model.hidden_size": 4096}, [], "model.hidden_size: store has 4096, this run has 64", id="hidden-size"
        ),
        pytest.param({}, ["--dtype", "float32"], None, id="dtype"),
    ]


@pytest.mark.parametrize("mode", [["--target", "cpu"], ["--gpu-golden"]], ids=["parity", "verify"])
@pytest.mark.parametrize(("changes", "args", "what"), _stale_cases())
def test_stale_store_is_refused_at_configure_saying_what_differs(project, mode, changes, args, what):
    goldens = project.path / "goldens"

    def change(manifest):
        for dotted, value in changes.items():
            section, field = dotted.split(".")
            manifest[section][field] = value

    edit_manifest(goldens, change)
    built = project.path / "built.txt"
    project.makeconftest(RECORD_BUILDS.format(path=str(built)))
    result = project.runpytest(*mode, *args)
    assert result.ret == USAGE_ERROR
    fix = f"pytest --gpu-golden --extract --model={DEFAULT_MODEL} --golden-dir={goldens}{PROJECT_FLAGS} --force-regen"
    if args:  # a run in another dtype: the extraction in its place asks for it
        fix = fix.replace("--decode-steps", "--dtype float32 --decode-steps")
        text = "the goldens are bfloat16 and this run asks for --dtype float32; drop --dtype to test them in "
        text += f"bfloat16, or extract float32 goldens in their place: {fix}"
    else:
        text = f"the goldens were made from another model or setting than {DEFAULT_MODEL} ({what}); extract them "
        text += f"again for this model: {fix}"
    assert f"ERROR: refusing the golden store: {goldens / 'manifest.json'}: {text}" in result.stderr.lines
    assert not built.exists()


@pytest.mark.parametrize("mode", [["--target", "cpu"], ["--gpu-golden"]], ids=["parity", "verify"])
def test_unknown_schema_version_is_a_usage_error_before_any_layer_runs(project, mode):
    goldens = project.path / "goldens"
    edit_manifest(goldens, lambda m: m.update(schema_version=3))
    built = project.path / "built.txt"
    project.makeconftest(RECORD_BUILDS.format(path=str(built)))
    result = project.runpytest(*mode)
    assert result.ret == USAGE_ERROR
    assert (
        f"ERROR: refusing the golden store: {goldens / 'manifest.json'}: schema version 3 is not one this "
        f"pytest-layerparity reads (it reads 1, 2); move {goldens} away (or delete it) and extract again: "
        f"{extract_cmd(goldens, model=DEFAULT_MODEL, flags=PROJECT_FLAGS)}"
    ) in result.stderr.lines
    assert not built.exists()


def test_a_store_of_an_unknown_dtype_is_a_usage_error_before_any_layer_runs(project):
    goldens = project.path / "goldens"
    edit_manifest(goldens, lambda m: m.update(dtype="int8"))
    built = project.path / "built.txt"
    project.makeconftest(RECORD_BUILDS.format(path=str(built)))
    result = project.runpytest("--target", "cpu")
    assert result.ret == USAGE_ERROR
    assert (
        f"ERROR: refusing the golden store: {goldens / 'manifest.json'}: dtype 'int8' is not one of bfloat16, "
        f"float16, float32; extract the goldens again: "
        f"pytest --gpu-golden --extract --model={DEFAULT_MODEL} --golden-dir={goldens}{PROJECT_FLAGS} --force-regen"
    ) in result.stderr.lines
    assert not built.exists()


def test_extraction_never_overwrites_a_store_of_an_unknown_schema(project):
    goldens = project.path / "goldens"
    edit_manifest(goldens, lambda m: m.update(schema_version=3))
    before = {p.name: p.read_bytes() for p in goldens.iterdir()}
    result = project.runpytest("--gpu-golden", "--extract", "--layers", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # refused once, before any test
    assert (
        f"ERROR: refusing the golden store: {goldens / 'manifest.json'}: schema version 3 is not one this "
        f"pytest-layerparity reads (it reads 1, 2); move {goldens} away (or delete it) and extract again: "
        f"{extract_cmd(goldens, model=DEFAULT_MODEL, flags=PROJECT_FLAGS)}"
    ) in result.stderr.lines
    assert {p.name: p.read_bytes() for p in goldens.iterdir()} == before


# -- partial extraction ----------------------------------------------------------------------


def test_extraction_killed_mid_write_keeps_earlier_layers_and_rerun_completes(fresh):
    """SIGKILL while layer 3's file is half written: the manifest lists exactly layers 0-2
    (and model_io), each verifies, the half-written temporary file is never read; then
    ``--extract --layers 3-5`` completes the store without touching layers 0-2."""
    store = fresh.path / "store"
    fresh.makeconftest(KILL_AT_LAYER_3)
    result = fresh.runpytest_subprocess("--gpu-golden", "--extract")
    assert result.ret == -signal.SIGKILL
    manifest = verify_store(store)
    assert set(manifest["files"]) == {"layer_0", "layer_1", "layer_2", "model_io"}
    assert not (store / "layer_00003.safetensors").exists()
    leftovers = temp_files(store)
    assert any(name.startswith(".layer_00003.safetensors.") for name in leftovers), leftovers
    with pytest.raises(GoldenError) as info:
        GoldenStore(store).load("layer_3")
    assert str(info.value) == f"{store}: no golden for layer_3; regenerate it with: {extract_cmd(store, '3')}"
    # the manifest cannot be made to read a temporary file either
    manifest["files"]["layer_3"] = {"file": leftovers[0], "sha256": "0" * 64, "bytes": 1}
    hostile = GoldenStore(fresh.path / "hostile")
    shutil.copytree(store, hostile.root)
    write_manifest(hostile.root, manifest)
    with pytest.raises(GoldenError) as info:
        hostile.load("layer_3")
    assert str(info.value) == (
        f"{hostile.manifest_path}: entry 'layer_3' names file {leftovers[0]!r}, which is not a plain "
        "safetensors file name inside the store; refusing to read it"
    )

    earlier = {i: file_state(store / f"layer_{i:05d}.safetensors") for i in range(3)}
    (fresh.path / "conftest.py").unlink()
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "3-5").assert_outcomes(passed=3)
    manifest = verify_store(store)
    assert set(manifest["files"]) == {f"layer_{i}" for i in range(6)} | {"model_io"}
    assert {i: file_state(store / f"layer_{i:05d}.safetensors") for i in range(3)} == earlier
    # one forward pass: layer 3's input (written now) is layer 2's output (written before the kill)
    assert torch.equal(
        load_file(store / "layer_00003.safetensors")["args.0"], load_file(store / "layer_00002.safetensors")["output"]
    )
    fresh.runpytest("--target", "cpu").assert_outcomes(passed=6)


def test_full_disk_leaves_the_store_unchanged(store_copy, monkeypatch):
    """ENOSPC halfway through a golden's temporary file: a GoldenError naming the file and
    the cause; the earlier file and the manifest are byte for byte what they were, and
    the half-written temporary file is gone. The same for a layer never written before."""
    root = store_copy.root
    manifest_before = store_copy.manifest_path.read_bytes()
    old = (root / "layer_00002.safetensors").read_bytes()
    entry = store_copy.load("layer_2")
    written: list[str] = []
    monkeypatch.setattr(tensorfile, "write_all", full_disk_for("layer_0000", written))
    for key, index in (("layer_2", 2), ("layer_7", 7)):
        path = root / f"layer_{index:05d}.safetensors"
        with pytest.raises(GoldenError) as info:
            store_copy.write(key, {"output": torch.ones(2)}, {"call": {"output": {"t": "output"}}, "layer": index})
        assert str(info.value) == (
            f"{path}: cannot write the golden for {key} (No space left on device [ENOSPC]); the store is unchanged "
            f"(the manifest does not list the new file; an earlier {path.name}, if any, is intact); "
            f"free space or fix the folder's permissions, then run: {extract_cmd(root, str(index))}"
        )
    assert len(written) == 2 and all(".tmp" in name for name in written)  # half of each was on disk
    assert store_copy.manifest_path.read_bytes() == manifest_before
    assert (root / "layer_00002.safetensors").read_bytes() == old
    assert torch.equal(store_copy.load("layer_2").tensors["output"], entry.tensors["output"])
    assert not (root / "layer_00007.safetensors").exists() and "layer_7" not in store_copy.keys()  # noqa: SIM118  a GoldenStore, not a dict
    assert temp_files(root) == []


def test_full_disk_while_writing_the_manifest_leaves_the_store_unchanged(store_copy, monkeypatch):
    root = store_copy.root
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    monkeypatch.setattr(tensorfile, "write_all", full_disk_for("manifest.json"))
    with pytest.raises(GoldenError) as info:
        store_copy.write("layer_2", {"output": torch.ones(2)}, {"call": {}})
    assert str(info.value).startswith(
        f"{root / 'layer_00002.safetensors'}: cannot write the golden for layer_2 (No space left on device [ENOSPC]); "
        "the store is unchanged"
    )
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before


def test_full_disk_when_creating_the_manifest(tmp_path, monkeypatch):
    store = GoldenStore(tmp_path / "store")
    monkeypatch.setattr(tensorfile, "write_all", full_disk_for("manifest.json"))
    with pytest.raises(GoldenError) as info:
        store.begin({"dtype": "float32"}, compare_keys=("dtype",))
    assert str(info.value) == (
        f"{store.manifest_path}: cannot write the manifest (No space left on device [ENOSPC]); the store is unchanged; "
        f"free space or fix the folder's permissions, then run: {extract_cmd(store.root)}"
    )
    assert store.read_manifest() is None and temp_files(store.root) == []


def test_any_other_os_error_during_extraction_fails_the_layer_with_a_message(fresh, monkeypatch):
    from pytest_layerparity.reference.extract import ReferenceSide

    def reference_run(self, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/models/m/model-00001-of-00002.safetensors")

    monkeypatch.setattr(ReferenceSide, "run", reference_run)
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "0")
    result.assert_outcomes(failed=1)
    assert (
        f"layer 0: /models/m/model-00001-of-00002.safetensors: Input/output error; nothing was recorded for this "
        f"layer; fix that, then run: pytest --gpu-golden --extract --model={DEFAULT_MODEL} "
        f"--golden-dir={fresh.path / 'store'}{PROJECT_FLAGS} --layers 0"
    ) in result.stdout.lines
    assert "Traceback" not in result.stdout.str()


def test_extraction_on_a_full_disk_fails_that_layer_saying_which_file_and_why(project, monkeypatch):
    """The layer whose write fails (its earlier golden exists) fails with the store's
    message; the others pass; its earlier golden is intact and still verifies."""
    goldens = project.path / "goldens"
    path = goldens / "layer_00002.safetensors"
    old = path.read_bytes()
    record = read_manifest(goldens)["files"]["layer_2"]
    monkeypatch.setattr(tensorfile, "write_all", full_disk_for(".layer_00002.safetensors."))
    result = project.runpytest("--gpu-golden", "--extract", "--layers", "1-3", "-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_extract_golden?layer_2? FAILED*"])
    assert (
        f"{path}: cannot write the golden for layer_2 (No space left on device [ENOSPC]); the store is unchanged "
        f"(the manifest does not list the new file; an earlier layer_00002.safetensors, if any, is intact); "
        "free space or fix the folder's permissions, then run: "
        f"{extract_cmd(goldens, '2', DEFAULT_MODEL, PROJECT_FLAGS)}"
    ) in result.stdout.lines
    assert path.read_bytes() == old
    manifest = verify_store(goldens)
    assert manifest["files"]["layer_2"] == record
    assert temp_files(goldens) == []


# -- concurrent writers ----------------------------------------------------------------------


def test_two_processes_extracting_disjoint_layers_into_one_store(fresh):
    store = fresh.path / "store"
    env = dict(os.environ, PJRT_DEVICE="CPU")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "--gpu-golden",
                "--extract",
                "--layers",
                layers,
            ],
            cwd=fresh.path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for layers in ("0-2", "3-5")
    ]
    outputs = [proc.communicate(timeout=300)[0].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert "3 passed" in outputs[0] and "3 passed" in outputs[1]
    manifest = verify_store(store)
    assert set(manifest["files"]) == {f"layer_{i}" for i in range(6)} | {"model_io"}
    assert temp_files(store) == []
    assert torch.equal(
        load_file(store / "layer_00003.safetensors")["args.0"], load_file(store / "layer_00002.safetensors")["output"]
    )


def test_xdist_workers_extracting_into_one_store(fresh):
    store = fresh.path / "store"
    result = fresh.runpytest_subprocess("--gpu-golden", "--extract", "-n", "2")
    result.assert_outcomes(passed=6)
    manifest = verify_store(store)
    assert set(manifest["files"]) == {f"layer_{i}" for i in range(6)} | {"model_io"}
    assert temp_files(store) == []


def test_a_concurrent_extraction_of_something_else_cannot_write_under_this_header(tmp_path):
    """Two extractions of different inputs race for an empty store: the one whose header
    the manifest no longer carries is refused at its write, never mixed in."""
    a, b = GoldenStore(tmp_path / "s"), GoldenStore(tmp_path / "s")
    a.begin({"inputs": {"seq_len": 32}}, compare_keys=("inputs.seq_len",))
    b.begin({"inputs": {"seq_len": 16}}, compare_keys=("inputs.seq_len",))  # the store is still empty
    b.write("layer_0", {"output": torch.ones(2)}, {"call": {}})
    with pytest.raises(GoldenError) as info:
        a.write("layer_1", {"output": torch.ones(2)}, {"call": {}})
    assert str(info.value) == (
        f"{a.manifest_path}: another extraction wrote to this store while this one ran "
        f"(inputs.seq_len: store has 16, this run has 32); use another --golden-dir, or delete {a.root} and extract "
        "again"
    )
    assert a.keys() == ["layer_0"]


# -- NaN / Inf -----------------------------------------------------------------------------


def test_nan_in_the_reference_fails_extraction_of_that_layer_saying_where(fresh, monkeypatch):
    """Layer 2 of the reference emits a NaN (in every dtype): the extraction fails once,
    naming the layer and what the other dtypes gave, and writes nothing (no NaN reaches the
    store, no store half made of this run)."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2DecoderLayer

    real_forward = MiniMaxM2DecoderLayer.forward

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.self_attn.layer_idx == 2:
            out = out.clone()
            out[0, 5, 7] = float("nan")
        return out

    monkeypatch.setattr(MiniMaxM2DecoderLayer, "forward", forward)
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "0-3", "-v")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "the reference model itself gives inf/NaN in bfloat16: first at layer 2, whose output holds 1 inf/NaN "
            "values (largest finite magnitude *; bfloat16 holds at most 3.38953e+38). This is the HuggingFace model's "
            "own forward on the golden input, not a port; no golden was written. Measured through layer 2: float16 "
            "overflows too (at layer 2), float32 overflows too (at layer 2); the checkpoint gives inf/NaN in every "
            "supported dtype: check its weights and config.json"
        ]
    )
    assert not (fresh.path / "store" / "manifest.json").exists()


@pytest.mark.parametrize(
    ("tensor", "value", "what"), [("output", float("nan"), "NaN"), ("args.0", float("inf"), "Inf")]
)
def test_nan_or_inf_written_into_a_golden_errors_its_parity_test_at_load(project, tensor, value, what):
    goldens = project.path / "goldens"
    tensors, metadata = read_entry(goldens / "layer_00002.safetensors")
    tensors[tensor][0, 3, 1] = value
    path = rewrite_entry(goldens, "layer_2", "layer_00002.safetensors", tensors, metadata)
    result = project.runpytest("--target", "cpu", "--layers", "1-2")
    result.assert_outcomes(passed=1, errors=1)
    assert (
        f"{path}: layer_2: tensor '{tensor}' holds {what} (first at index (0, 3, 1)); "
        f"regenerate it with: {extract_cmd(goldens, '2', DEFAULT_MODEL, PROJECT_FLAGS)}"
    ) in result.stdout.lines


# -- missing goldens -------------------------------------------------------------------------


def test_missing_goldens_error_with_the_extraction_command(project):
    goldens = project.path / "goldens"
    edit_manifest(goldens, lambda m: m["files"].pop("layer_5"))
    (goldens / "layer_00004.safetensors").unlink()
    result = project.runpytest("--target", "cpu", "--layers", "3-5")
    result.assert_outcomes(passed=1, errors=2)
    lines = result.stdout.lines
    assert (
        f"{goldens}: no golden for layer_5; extract it with: {extract_cmd(goldens, '5', DEFAULT_MODEL, PROJECT_FLAGS)}"
    ) in lines
    assert (
        f"{goldens / 'layer_00004.safetensors'}: cannot read the golden for layer_4 (No such file or directory "
        f"[ENOENT]); regenerate it with: {extract_cmd(goldens, '4', DEFAULT_MODEL, PROJECT_FLAGS)}"
    ) in lines


def test_no_store_at_all_is_one_usage_error_with_the_extraction_command(project):
    shutil.rmtree(project.path / "goldens")
    goldens = project.path / "goldens"
    result = project.runpytest("--target", "cpu")
    assert result.ret == USAGE_ERROR
    assert result.stderr.lines == [
        f"ERROR: refusing the golden store: no golden store at {goldens} (no manifest.json); extract it with: "
        f"pytest --gpu-golden --extract --model={DEFAULT_MODEL} --golden-dir={goldens}",
        "",
    ]


# -- hostile files -------------------------------------------------------------------------


def test_a_pickle_is_never_unpickled(store_copy, tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = store_copy.root / "layer_00001.safetensors"
    data = pickle.dumps({"output": Payload()})
    path.write_bytes(data)
    edit_manifest(
        store_copy.root,
        lambda m: m["files"]["layer_1"].update({"sha256": golden.hashlib.sha256(data).hexdigest(), "bytes": len(data)}),
    )
    with pytest.raises(GoldenError) as info:
        store_copy.load("layer_1")
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable safetensors file (")
    assert message.endswith(f"); regenerate it with: {extract_cmd(store_copy.root, '1')}")
    assert not marker.exists()


def test_a_symlink_out_of_the_store_is_refused(store_copy, tmp_path):
    """Even when it points to a valid golden whose sha256 the manifest lists."""
    outside = tmp_path / "elsewhere" / "layer_00001.safetensors"
    outside.parent.mkdir()
    shutil.copy(store_copy.root / "layer_00001.safetensors", outside)
    (store_copy.root / "layer_00001.safetensors").unlink()
    (store_copy.root / "layer_00001.safetensors").symlink_to(outside)
    with pytest.raises(GoldenError) as info:
        store_copy.load("layer_1")
    assert str(info.value) == (
        f"{store_copy.manifest_path}: entry 'layer_1' points outside the store ('layer_00001.safetensors' leads to "
        f"{outside}); refusing to read it"
    )


def test_a_symlink_inside_the_store_is_read(store_copy):
    root = store_copy.root
    (root / "real.safetensors").write_bytes((root / "layer_00001.safetensors").read_bytes())
    (root / "layer_00001.safetensors").unlink()
    (root / "layer_00001.safetensors").symlink_to("real.safetensors")
    assert store_copy.load("layer_1").metadata["layer"] == 1


def test_a_fifo_or_folder_named_like_a_golden_is_refused_without_hanging(store_copy):
    root = store_copy.root
    (root / "layer_00001.safetensors").unlink()
    os.mkfifo(root / "layer_00001.safetensors")
    (root / "layer_00002.safetensors").unlink()
    (root / "layer_00002.safetensors").mkdir()
    for index in (1, 2):
        with pytest.raises(GoldenError) as info:
            store_copy.load(f"layer_{index}")
        assert str(info.value) == (
            f"{root / f'layer_{index:05d}.safetensors'}: not a regular file; refusing to read it as the golden for "
            f"layer_{index}; regenerate it with: {extract_cmd(root, str(index))}"
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: m["files"]["layer_1"].update(file="../outside.safetensors"),
            "{manifest}: entry 'layer_1' names file '../outside.safetensors', which is not a plain safetensors file "
            "name inside the store; refusing to read it",
        ),
        (
            lambda m: m["files"]["layer_1"].update(file="/etc/passwd.safetensors"),
            "{manifest}: entry 'layer_1' names file '/etc/passwd.safetensors', which is not a plain safetensors file "
            "name inside the store; refusing to read it",
        ),
        (
            lambda m: m["files"]["layer_1"].update(file="manifest.json"),
            "{manifest}: entry 'layer_1' names file 'manifest.json', which is not a plain safetensors file "
            "name inside the store; refusing to read it",
        ),
        (
            lambda m: m["files"].update(layer_1="layer_00001.safetensors"),
            "{manifest}: entry 'layer_1' is a string, not an object with file, sha256 and bytes; "
            "move {root} away (or delete it) and extract again: pytest --gpu-golden --extract --golden-dir={root}",
        ),
        (
            lambda m: m.update(files=[]),
            "{manifest}: the manifest's 'files' is a list, not an object of entries; "
            "move {root} away (or delete it) and extract again: pytest --gpu-golden --extract --golden-dir={root}",
        ),
        (
            lambda m: m.pop("files"),
            "{manifest}: the manifest has no 'files' table; "
            "move {root} away (or delete it) and extract again: pytest --gpu-golden --extract --golden-dir={root}",
        ),
        (
            lambda m: m.update(schema_version=True),
            "{manifest}: schema version True is not one this pytest-layerparity reads (it reads 1, 2); "
            "move {root} away (or delete it) and extract again: pytest --gpu-golden --extract --golden-dir={root}",
        ),
    ],
    ids=["dotdot", "absolute", "not-safetensors", "entry-not-object", "files-not-object", "no-files", "schema-bool"],
)
def test_hostile_manifests_are_refused(store_copy, change, message):
    edit_manifest(store_copy.root, change)
    with pytest.raises(GoldenError) as info:
        store_copy.load("layer_1")
    assert str(info.value) == message.format(manifest=store_copy.manifest_path, root=store_copy.root)


@pytest.mark.parametrize(("text", "kind"), [("[1, 2]", "a list"), ('"x"', "a string"), ("{", None)])
def test_a_manifest_that_is_not_an_object_is_refused(store_copy, text, kind):
    store_copy.manifest_path.write_text(text)
    with pytest.raises(GoldenError) as info:
        store_copy.read_manifest()
    hint = f"move {store_copy.root} away (or delete it) and extract again: {extract_cmd(store_copy.root)}"
    if kind:
        assert (
            str(info.value) == f"{store_copy.manifest_path}: the manifest is not a JSON object (it is {kind}); {hint}"
        )
    else:
        assert str(info.value).startswith(f"{store_copy.manifest_path}: the manifest is not valid JSON (")
        assert str(info.value).endswith(hint)


def test_a_golden_filed_under_another_layer_is_refused(store_copy):
    """layer_00000's content copied over layer_00001 and the manifest updated: the file
    says which layer it is."""
    root = store_copy.root
    tensors, metadata = read_entry(root / "layer_00000.safetensors")
    path = rewrite_entry(root, "layer_1", "layer_00001.safetensors", tensors, metadata)
    with pytest.raises(GoldenError) as info:
        store_copy.load("layer_1")
    assert str(info.value) == (
        f"{path}: layer_1: the file holds the golden of layer 0, not of layer_1; regenerate it with: "
        f"{extract_cmd(root, '1')}"
    )


def test_a_golden_missing_a_tensor_of_its_call_is_refused(store_copy):
    root = store_copy.root
    tensors, metadata = read_entry(root / "layer_00001.safetensors")
    del tensors["kwargs.position_ids"]
    path = rewrite_entry(root, "layer_1", "layer_00001.safetensors", tensors, metadata)
    with pytest.raises(GoldenError) as info:
        store_copy.load("layer_1")
    assert str(info.value) == (
        f"{path}: layer_1: its call refers to tensors the file does not hold (kwargs.position_ids); "
        f"regenerate it with: {extract_cmd(root, '1')}"
    )


# -- bad options ---------------------------------------------------------------------------


def test_model_option_that_is_a_file_or_missing_folder(project):
    weights = project.path / "model.safetensors"
    weights.write_bytes(b"")
    for path in (weights, project.path / "no_such_folder"):
        result = project.runpytest("--target", "cpu", f"--model={path}")
        assert result.ret == USAGE_ERROR
        assert (
            f"ERROR: {path} has no config.json; --model must be a HuggingFace model folder "
            "(config.json and safetensors weights)"
        ) in result.stderr.lines


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["-o", "layerparity_min_pearson=nan"], "-o layerparity_min_pearson=nan: 'nan' is not a finite number"),
        (
            ["-o", "layerparity_max_mean_abs_diff=-0.5"],
            "-o layerparity_max_mean_abs_diff=-0.5: '-0.5' is negative; a tolerance is 0 or more (e.g. 0.01)",
        ),
        (
            ["-o", "layerparity_min_similarity=inf"],
            "-o layerparity_min_similarity=inf: 'inf' is not a finite number",
        ),
        (["--seq-len", "0"], "error: argument --seq-len: '0' must be a positive integer (1 or more)"),
    ],
)
def test_bad_thresholds_are_usage_errors(project, args, line):
    result = project.runpytest("--target", "cpu", *args)
    assert result.ret == USAGE_ERROR
    # pytest's line "ERROR: ..." or argparse's "<prog>: error: ...", prog being "pytest" or, in process,
    # "pytest.main()"
    assert any(text.split(": ", 1)[-1] == line for text in result.stderr.lines), result.stderr.lines


# -- missing optional dependencies -----------------------------------------------------------

HIDE_AND_RUN = "import sys; sys.modules[{name!r}] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"


@pytest.mark.parametrize(
    ("hidden", "args", "line"),
    [
        (
            "torch_xla",
            ["--xla"],
            "ERROR: --xla: torch_xla not installed; pip install 'pytest-layerparity[xla]'   (torch-xla==2.9.* with "
            "torch==2.9.*)",
        ),
        (
            "transformers",
            ["--gpu-golden", "--extract"],
            "ERROR: --gpu-golden: transformers not installed; pip install 'pytest-layerparity[reference]'   "
            "(transformers and accelerate)",
        ),
        (
            "transformers",
            ["--target", "cpu"],
            "ERROR: --target cpu: transformers not installed; pip install 'pytest-layerparity[reference]'   "
            "(transformers and accelerate)",
        ),
    ],
    ids=["xla", "extract", "target-cpu"],
)
def test_missing_optional_dependency_is_a_usage_error_with_the_pip_command(project, hidden, args, line):
    """A process where the module cannot be imported (importlib finds no spec for it)."""
    result = project.run(sys.executable, "-c", HIDE_AND_RUN.format(name=hidden), "-p", "no:cacheprovider", *args)
    assert result.ret == USAGE_ERROR
    assert line in result.stderr.lines
    assert "Traceback" not in result.stderr.str()


def test_verify_calls_each_layer_with_its_stored_inputs(project):
    """``--gpu-golden`` (no ``--extract``) re-runs each layer on the inputs its golden stores,
    not on what the layers before it computed here: a golden whose stored input no longer
    gives its stored output fails, that layer alone (before, the re-run chained through the
    model and passed it; and a near tie its experts broke another way on another device,
    measured on an H200, failed every layer after it)."""
    goldens = project.path / "goldens"
    tensors, metadata = read_entry(goldens / "layer_00002.safetensors")
    hidden = tensors["args.0"]
    noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
    tensors["args.0"] = (hidden.float() + 0.05 * hidden.float().std() * noise).to(hidden.dtype)
    rewrite_entry(goldens, "layer_2", "layer_00002.safetensors", tensors, metadata)
    result = project.runpytest("--gpu-golden", "-v")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*test_golden_reproducible?layer_2? FAILED*"])
    result.stdout.fnmatch_lines(["*test_golden_reproducible?layer_3? PASSED*"])
