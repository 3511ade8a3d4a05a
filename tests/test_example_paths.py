"""Every example and command-line tool checks its paths up front: a missing or wrong path is a usage
error (exit status 2) that says what was wrong and what to create or pass, never a traceback.

The examples run in subprocesses with a ``torch`` on the path that fails when imported, so each one
is shown to check its command line before it imports torch (and returns in a fraction of a second);
``python -m zerofn`` imports torch with the package, so those few run with the real one, all at once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

# id -> (command line after the interpreter, expected text on stderr, whether it may import torch).
# "{m}" is a directory that does not exist, "{d}" one that does (empty), "{f}" an existing file.
CASES = {
    "bench_checkpoint-dir": (
        ["examples/bench_checkpoint.py", "--dir", "{m}/d"],
        "--dir {m}/d: no such directory; create it first (mkdir -p {m}/d)",
        False,
    ),
    "bench_checkpoint-dir-file": (
        ["examples/bench_checkpoint.py", "--dir", "{f}"],
        "--dir {f} is a file, not a directory",
        False,
    ),
    "bench_offload-path": (
        ["examples/bench_offload.py", "--path", "{m}/d"],
        "--path {m}/d: no such directory; create it first (mkdir -p {m}/d)",
        False,
    ),
    "bench_infinity-path": (
        ["examples/bench_infinity.py", "--path", "{m}/d"],
        "--path {m}/d: no such directory; create it first (mkdir -p {m}/d)",
        False,
    ),
    "train_gpt-deepspeed": (
        ["examples/train_gpt.py", "--deepspeed", "{m}/ds.json"],
        "--deepspeed {m}/ds.json: no such file; pass a DeepSpeed config JSON file",
        False,
    ),
    "train_gpt-ckpt-dir": (
        ["examples/train_gpt.py", "--ckpt-dir", "{m}/a"],
        "--ckpt-dir {m}/a: neither it nor its parent {m} exists; create the parent (mkdir -p {m})",
        False,
    ),
    "train_gpt-out": (
        ["examples/train_gpt.py", "--out", "{m}/final.pt"],
        "--out {m}/final.pt: the directory it goes in, {m}, does not exist; create it (mkdir -p {m})",
        False,
    ),
    "train_gpt-jsonl": (
        ["examples/train_gpt.py", "--jsonl", "{m}/metrics.jsonl"],
        "--jsonl {m}/metrics.jsonl: the directory it goes in, {m}, does not exist",
        False,
    ),
    "train_gpt-tensorboard": (
        ["examples/train_gpt.py", "--tensorboard", "{m}/tb"],
        "--tensorboard {m}/tb: neither it nor its parent {m} exists",
        False,
    ),
    "train_gpt-out-is-dir": (
        ["examples/train_gpt.py", "--out", "{d}"],
        "--out {d} is a directory; pass the name of a file to write",
        False,
    ),
    "finetune_hf-model": (
        ["examples/finetune_hf.py", "--model", "{m}/llama"],
        "--model {m}/llama: no such file or directory; pass a local model directory (with a config.json)",
        False,
    ),
    "finetune_hf-model-no-config": (
        ["examples/finetune_hf.py", "--model", "{d}"],
        "a model directory holds a config.json",
        False,
    ),
    "finetune_hf-export": (
        ["examples/finetune_hf.py", "--export", "{m}/out"],
        "--export {m}/out: neither it nor its parent {m} exists",
        False,
    ),
    "finetune_hf-ckpt-dir": (
        ["examples/finetune_hf.py", "--ckpt-dir", "{m}/ckpt"],
        "--ckpt-dir {m}/ckpt: neither it nor its parent {m} exists",
        False,
    ),
    "zerofn-consolidate": (
        ["-m", "zerofn", "consolidate", "{m}/step_10", "{d}/model.safetensors"],
        "{m}/step_10: no such checkpoint directory; pass a directory zf.checkpoint.save wrote",
        True,
    ),
    "zerofn-verify": (
        ["-m", "zerofn", "verify", "{f}"],
        "{f} is a file; pass the checkpoint's directory",
        True,
    ),
    "zerofn-run": (
        ["-m", "zerofn", "run", "--nproc_per_node", "2", "{m}/train.py"],
        "python -m zerofn run: {m}/train.py: no such script; pass the path of the training script",
        True,
    ),
    "zerofn-plan": (
        ["-m", "zerofn", "plan", "--model", "{m}/config.json", "--gpu-memory", "80GB"],
        "--model {m}/config.json: no such file or directory; pass a Hugging Face config.json",
        True,
    ),
}


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    base = tmp_path_factory.mktemp("paths")
    poison = base / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch was imported before the paths were checked')\n")
    (base / "empty").mkdir()
    (base / "file.txt").write_text("not a directory\n")
    return {
        "m": str(base / "missing"),
        "d": str(base / "empty"),
        "f": str(base / "file.txt"),
        "poison": str(base / "poison"),
    }


def _fill(text: str, where: dict) -> str:
    return text.format(**where)


@pytest.fixture(scope="module")
def runs(where):
    """Every case at once (the ones importing torch overlap), each's (exit status, stderr)."""
    procs = {}
    for name, (argv, _, torch_ok) in CASES.items():
        env = dict(os.environ)
        if not torch_ok:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [where["poison"], env.get("PYTHONPATH")]))
        procs[name] = subprocess.Popen(
            [sys.executable, *(_fill(a, where) for a in argv)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = (proc.returncode, stdout + stderr)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_path_is_a_usage_error_that_says_what_to_do(name, runs, where):
    rc, text = runs[name]
    want = _fill(CASES[name][1], where)
    assert "Traceback" not in text, text
    assert rc == 2, (rc, text)
    assert want in " ".join(text.split()), text


def test_a_directory_to_write_to_is_made_when_its_parent_exists(where, tmp_path):
    made = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--ckpt-dir", str(made), "--out", _fill("{m}/x.pt", where)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": where["poison"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--out" in proc.stderr, proc.stderr  # --ckpt-dir passed its check first
    assert made.is_dir()


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"_paths_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _usage_error(capsys, fn, *args) -> str:
    with pytest.raises(SystemExit) as e:
        fn(*args)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def test_the_benchmarks_check_the_file_they_write_before_running(capsys, where):
    gpu = _example("bench_gpu")
    err = _usage_error(capsys, gpu.parse_args, ["--device", "cpu", "--out", _fill("{m}/gpu.md", where)])
    assert _fill("--out {m}/gpu.md: the directory it goes in, {m}, does not exist", where) in err
    groups = _example("bench_optim_groups")
    err = _usage_error(capsys, groups.main, ["--json", _fill("{m}/groups.json", where)])
    assert _fill("--json {m}/groups.json: the directory it goes in, {m}, does not exist", where) in err


def test_the_command_line_tools_check_their_outputs_and_scripts(capsys, where):
    from zerofn.__main__ import main
    from zerofn.launch.cli import _missing_script
    from zerofn.launch.cli import main as run
    from zerofn.plan.cli import main as plan

    err = _usage_error(capsys, main, ["consolidate", where["d"], _fill("{m}/model.safetensors", where)])
    assert _fill("{m}/model.safetensors: the directory it goes in, {m}, does not exist", where) in err
    err = _usage_error(capsys, main, ["consolidate", where["d"], where["d"]])
    assert _fill("{d} is a directory; pass the .safetensors file to write", where) in err
    err = _usage_error(capsys, plan, ["--model", where["d"], "--gpu-memory", "80GB"])
    assert _fill("--model {d}: the directory holds no config.json", where) in err
    err = _usage_error(capsys, plan, ["--params", "1B", "--gpu-memory", "80GB", "--plot", _fill("{m}/p.png", where)])
    assert _fill("--plot {m}/p.png: the directory it goes in, {m}, does not exist", where) in err
    assert run(["--nproc_per_node", "2", where["d"]]) == 2
    assert _fill("python -m zerofn run: {d} is a directory; pass the training script", where) in capsys.readouterr().err
    assert _missing_script(["--nproc_per_node", "1", "-m"], ["package.train"]) is None  # a module, not a path
