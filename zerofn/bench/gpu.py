"""``python -m zerofn.bench gpu --out DIR``: one command that proves and measures zerofn on one CUDA GPU.

Three parts, each in processes of its own, written to ``DIR/report.json`` and
``DIR/report.md`` (and the raw ``DIR/checks.jsonl`` and ``DIR/log.txt``):

1. **Correctness and host syncs** (:mod:`zerofn.bench.gpu_checks`, one
   process under ``torch.distributed.run --nproc_per_node 1``: NCCL): every
   composition against plain torch on the same GPU (bit for bit in fp32,
   within a stated tolerance where the arithmetic differs), and the
   synchronising calls of steps 3 to 10 counted by CUDA's own sync check and
   by the profiler, then confirmed with ``set_sync_debug_mode("error")``.
   A case that crashes its process is reported and the others run on in a
   new one.
2. **offload on CUDA**: ``tests/transforms/offload/test_offload_cuda.py`` under
   pytest, when the command runs from a checkout that has it.
3. **Speed and memory** (:mod:`zerofn.bench.gpu_speed`, one fresh process
   per system): the GPT of about 1.4 B parameters in bf16 (16 x 1024 tokens)
   under ``amp`` against torch AMP, ``amp(shard_params)`` against FSDP2 with
   a bf16 ``MixedPrecisionPolicy``, ``amp(shard_grads)``/``amp(shard_params)``
   against DeepSpeed ZeRO-2/3 and the offloaded step against ZeRO-Offload
   when ``import deepspeed`` works; loops of consecutive steps after warm-up;
   tokens/s, the fraction of the GPU's dense bf16 peak, peak allocated memory
   against the state's ``state_bytes`` and against torch's.

``--quick`` (about 4 minutes on an H200) trains a 0.2 B GPT for the speed
part, without DeepSpeed's rows unless ``--systems`` names them; the full
form (under 10 minutes) the 1.4 B one. ``--device cpu`` runs
every part at tiny sizes on gloo (no sync counts, no peak fraction): the
check that the command starts, which CI runs::

    python -m zerofn.bench gpu --out /tmp/gpu               # the full form, on a machine with one GPU
    python -m zerofn.bench gpu --quick --out /tmp/gpu       # the 4-minute form
    python -m zerofn.bench gpu --device cpu --out /tmp/gpu  # the CPU smoke form
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import torch

from zerofn.bench import gpu_checks, gpu_speed

# (dim, layers, heads, vocab, seq_len, batch, warm-up steps, timed steps, rounds)
SPEED_SHAPES = {
    "full": dict(dim=2048, layers=24, heads=16, vocab=50304, seq_len=1024, batch=16, warmup=3, steps=10, rounds=2),
    "quick": dict(dim=1024, layers=12, heads=8, vocab=50304, seq_len=1024, batch=8, warmup=2, steps=8, rounds=2),
    "cpu": dict(dim=64, layers=2, heads=2, vocab=256, seq_len=32, batch=2, warmup=1, steps=2, rounds=1),
}
# (zerofn, its peer, the goal: zerofn's step time at most this multiple of the peer's)
PAIRS = (
    ("zf-amp", "torch-amp", 1.0),
    ("zf-z3-amp", "fsdp2", 1.0),
    ("zf-z2-amp", "deepspeed-z2", 1.0),
    ("zf-z3-amp", "deepspeed-z3", 1.0),
    ("zf-z2-amp-offload", "deepspeed-z2-offload", 0.8),
)
MFU_GOAL = 0.55  # of the dense bf16 peak, for zf-amp on the 1.4 B GPT
OFFLOAD_TEST = os.path.join("tests", "transforms", "offload", "test_offload_cuda.py")


def speed_systems(deepspeed: bool) -> list[str]:
    """The systems the speed part trains, in order: each zerofn system beside its peer."""
    names = ["torch-amp", "zf-amp", "fsdp2", "zf-z3-amp"]
    if deepspeed:
        names += ["deepspeed-z2", "zf-z2-amp", "deepspeed-z3"]
    names.append("zf-z2-amp-offload")
    if deepspeed:
        names.append("deepspeed-z2-offload")
    return names


class Log:
    """Prints and keeps every line in ``DIR/log.txt`` (the report's companion)."""

    def __init__(self, path: str):
        self.f = open(path, "a")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.f.write(text + "\n")
        self.f.flush()


# ---------------------------------------------------------------- part 1: the checks


def run_checks(args, out: str, log: Log, deadline: float) -> list[dict]:
    """Every case in a child under torch.distributed.run; a child that dies mid-case is restarted on the
    cases after it, the case it was running reported as crashed."""
    path = os.path.join(out, "checks.jsonl")
    done: dict[str, dict] = {}
    todo = list(args.cases)
    while todo:
        left = deadline - time.monotonic()
        if left < 20:
            for name in todo:
                done[name] = {"case": name, "correct": None, "skipped": "out of the time budget"}
            break
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        cmd += ["-m", "zerofn.bench.gpu_checks", "--device", args.device, "--out", path, "--cases", *todo]
        cmd += ["--tiny"] if args.device == "cpu" else []
        code, tail = _child(cmd, log, timeout=left)
        for line in open(path) if os.path.exists(path) else ():
            rec = json.loads(line)
            done[rec["case"]] = rec
        todo = [n for n in todo if n not in done]
        if todo and code == 0:
            break  # the child ended cleanly without them: nothing more to learn by rerunning
        if todo:  # the case in flight took its process down (or the time ran out): report it, go on
            name = todo.pop(0)
            why = "timed out" if code is None else f"the process exited {code}"
            done[name] = {"case": name, "correct": False, "error": f"crashed: {why}", "tail": tail[-600:]}
            log(f"check {name}: CRASHED ({why})")
    return [done[n] for n in args.cases if n in done]


def _child(cmd: list[str], log: Log, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a process group of its own, its output appended to the log; (its exit code, or None
    when it ran past ``timeout`` and was killed with everything it started; the output's tail)."""
    log(f"$ {shlex.join(cmd)}")
    start = log.f.tell()
    proc = subprocess.Popen(cmd, stdout=log.f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    log.f.flush()
    with open(log.f.name) as f:
        f.seek(start)
        tail = f.read()[-4000:]
    for line in tail.splitlines():
        if line.startswith("check ") or (" passed" in line or " failed" in line) and "==" in line:
            print("  " + line, flush=True)
    return code, tail


# ---------------------------------------------------------------- part 2: the CUDA offload tests


def run_offload_tests(args, log: Log, deadline: float) -> dict:
    if args.device != "cuda":
        return {"skipped": "needs CUDA"}
    if not os.path.exists(OFFLOAD_TEST):
        return {"skipped": f"{OFFLOAD_TEST} not found (run from a checkout to include it)"}
    left = deadline - time.monotonic()
    if left < 30:
        return {"skipped": "out of the time budget"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", OFFLOAD_TEST]
    code, tail = _child(cmd, log, timeout=min(left, 240))
    summary = next((ln for ln in reversed(tail.splitlines()) if " passed" in ln or " failed" in ln), "")
    return {"exit": code, "summary": summary.strip("= "), "ok": code == 0}


# ---------------------------------------------------------------- part 3: speed


def run_speed(args, shape: dict, log: Log, deadline: float) -> list[dict]:
    # DeepSpeed's rows only in the full form: compiling its CPU Adam and its three rows would take the
    # quick form past its 4 minutes, and at 0.2 B its step times say little of the 1.4 B model's
    deepspeed = args.device == "cuda" and not args.quick and importlib.util.find_spec("deepspeed") is not None
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    results = []
    for system in args.systems or speed_systems(deepspeed):
        left = deadline - time.monotonic()
        if left < 30:
            results.append({"system": system, "skipped": "out of the time budget"})
            continue
        sargs = gpu_speed.parse_args([*flags, "--device", args.device, "--timeout", str(min(left, 200))])
        t0 = time.monotonic()
        r = gpu_speed.run_system(sargs, system)
        if "output_tail" in r:  # a failed child's own words, for the log (the report keeps one line)
            log.f.write(f"---- {system} failed; the end of its output:\n{r.pop('output_tail')}\n----\n")
        results.append(r)
        what = r.get("skipped") or f"{1e3 * r['step_s']:.1f} ms/step, {r['peak_bytes'] / 2**30:.2f} GiB peak"
        log(f"speed {system}: {what} ({time.monotonic() - t0:.0f} s)")
    if not deepspeed and not args.systems:
        for name in ("deepspeed-z2", "deepspeed-z3", "deepspeed-z2-offload"):
            why = "CUDA only" if args.device != "cuda" else "full form only" if args.quick else "not installed"
            results.append({"system": name, "skipped": why})
    return results


def comparisons(speed: list[dict], peak: float | None) -> list[dict]:
    by = {r["system"]: r for r in speed if "skipped" not in r}
    out = []
    for mine, peer, goal in PAIRS:
        if mine in by and peer in by:
            ratio = by[mine]["step_s"] / by[peer]["step_s"]
            peak_ratio = by[mine]["peak_bytes"] / by[peer]["peak_bytes"]
            out.append(
                dict(zerofn=mine, peer=peer, time_ratio=ratio, peak_ratio=peak_ratio, goal=goal, met=ratio <= goal)
            )
    if peak and "zf-amp" in by:
        frac = by["zf-amp"]["achieved_tflops"] / by["zf-amp"]["world"] / peak
        out.append(dict(zerofn="zf-amp", peer="bf16 peak", fraction=frac, goal=MFU_GOAL, met=frac >= MFU_GOAL))
    return out


# ---------------------------------------------------------------- the report


def _fmt(x, spec: str = ".3g") -> str:
    return "" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# zerofn on one GPU",
        "",
        f"- date: {env['date']}; device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}); "
        f"zerofn {env['zerofn']}",
        f"- command: `{env['command']}`; {report['seconds']:.0f} s in all",
        "",
        "## Correctness and host syncs",
        "",
        "Each composition trains the same model as plain torch on the same device for "
        f"{gpu_checks.STEPS} steps (torch's fused AdamW; autocast for amp) and the parameters are compared. "
        "Syncs: steps 3 to 10 under `torch.cuda.set_sync_debug_mode('warn')` and the profiler "
        "(`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`), per step; then, where "
        "that saw none, under `'error'`.",
        "",
        "| case | correct | expected | max abs diff | torch rerun diff | CUDA sync warnings / step "
        "| profiler syncs / step | 'error' mode | note |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in report["checks"]:
        ok = {True: "yes", False: "**no**", None: "-"}[r.get("correct")]
        note = r.get("error") or r.get("skipped") or r.get("note") or ""
        if r.get("where") and r.get("error"):
            note += f" ({'; '.join(r['where'][-2:])})"
        if r.get("sync_where"):
            note += f" syncs at: {', '.join(r['sync_where'][:4])}"
        for key in ("tokens_equal", "graph_breaks", "skipped_steps", "scales", "params_kept"):
            if key in r:
                note += f" {key}={r[key]}"
        lines.append(
            f"| {r['case']} | {ok} | {r.get('expect', '')} | {_fmt(r.get('max_abs_diff'))} "
            f"| {_fmt(r.get('torch_rerun_diff'))} | {_fmt(r.get('sync_warnings_per_step'), '.2f')} "
            f"| {_fmt(r.get('profiler_syncs_per_step'), '.2f')} | {r.get('sync_error_mode', r.get('syncs', ''))} "
            f"| {note.strip().replace('|', '/')} |"
        )
    t = report["offload_tests"]
    lines += ["", f"`{OFFLOAD_TEST}`: " + (t.get("skipped") or f"{t['summary']} (exit {t['exit']})")]
    lines += ["", "## Speed and memory", ""]
    shape = report["speed_shape"]
    lines.append(
        f"GPT of {report.get('speed_params', 0) / 1e9:.2f} B parameters (dim {shape['dim']}, {shape['layers']} "
        f"layers, vocab {shape['vocab']}), {shape['batch']} x {shape['seq_len']} tokens per step, bf16; the "
        f"fastest of {shape['rounds']} loop(s) of {shape['steps']} consecutive steps after {shape['warmup']} "
        "warm-up steps; peak: `torch.cuda.max_memory_allocated` over set-up and steps; state: "
        "`zf.memory.state_bytes` on the device."
    )
    lines += [
        "",
        "| system | step ms | tokens/s | of bf16 peak | peak GiB | held GiB | state GiB (device) | loss | note |",
    ]
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    peak = report["peak_tflops"]
    for r in report["speed"]:
        if "skipped" in r:
            lines.append(f"| {r['system']} | | | | | | | | {r['skipped']} |")
            continue
        frac = f"{100 * r['achieved_tflops'] / r['world'] / peak:.1f} %" if peak else "n/a"
        state = (r.get("state_bytes") or {}).get(report["environment"]["device_type"])
        lines.append(
            f"| {r['system']} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | {frac} "
            f"| {r['peak_bytes'] / 2**30:.2f} | {r['held_bytes'] / 2**30:.2f} "
            f"| {'' if state is None else f'{state / 2**30:.2f}'} | {r['loss']:.4f} | |"
        )
    lines += [
        "",
        "| zerofn | against | step time ratio | peak memory ratio | goal | met |",
        "|---|---|---:|---:|---|---|",
    ]
    for c in report["comparisons"]:
        if "fraction" in c:
            lines.append(
                f"| {c['zerofn']} | {c['peer']} | {100 * c['fraction']:.1f} % | | >= {100 * c['goal']:.0f} % | {'yes' if c['met'] else 'no'} |"
            )
        else:
            lines.append(
                f"| {c['zerofn']} | {c['peer']} | {c['time_ratio']:.3f} | {c['peak_ratio']:.3f} "
                f"| <= {c['goal']:.1f} | {'yes' if c['met'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerofn.bench gpu", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", required=True, metavar="DIR", help="folder for report.json, report.md, checks.jsonl, log.txt"
    )
    p.add_argument("--quick", action="store_true", help="a 0.2 B GPT for the speed part: about 4 minutes")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: tiny sizes on gloo, a smoke run")
    p.add_argument("--parts", nargs="+", choices=["checks", "tests", "speed"], default=["checks", "tests", "speed"])
    p.add_argument("--cases", nargs="+", choices=gpu_checks.CASES, default=list(gpu_checks.CASES))
    p.add_argument(
        "--systems",
        nargs="+",
        choices=gpu_speed.SYSTEMS,
        default=None,
        help="the speed part's systems (default: each zerofn system beside its peer)",
    )
    p.add_argument("--budget", type=float, default=None, help="seconds in all (default 570, --quick 230)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not recognised")
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = 230.0 if args.quick else 570.0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    os.makedirs(args.out, exist_ok=True)
    for name in ("checks.jsonl", "log.txt"):
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    log = Log(os.path.join(args.out, "log.txt"))
    gpu = gpu_speed.gpu_name(args.device)  # exits with a message when CUDA is asked for and absent
    peak = None
    if args.device == "cuda":
        peak = args.peak_tflops or gpu_speed.peak_tflops_for(gpu)
    given = sys.argv[1:] if argv is None else ["gpu", *argv]
    import zerofn

    report: dict = {
        "environment": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": gpu,
            "device_type": args.device,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "zerofn": getattr(zerofn, "__version__", "?"),
            "command": shlex.join(["python", "-m", "zerofn.bench", *given]),
        },
        "peak_tflops": peak,
    }
    log(f"zerofn GPU check on {gpu}: parts {' '.join(args.parts)}, budget {args.budget:.0f} s")
    report["checks"] = run_checks(args, args.out, log, deadline) if "checks" in args.parts else []
    report["offload_tests"] = (
        run_offload_tests(args, log, deadline) if "tests" in args.parts else {"skipped": "not asked"}
    )
    shape = SPEED_SHAPES["cpu" if args.device == "cpu" else "quick" if args.quick else "full"]
    report["speed_shape"] = shape
    from zerofn.bench.gpt import GPTConfig

    cfg = GPTConfig(**{k: shape[k] for k in ("vocab", "seq_len", "dim", "heads", "layers")})
    report["speed_params"] = gpu_speed.gpt_params(cfg)
    report["speed"] = run_speed(args, shape, log, deadline) if "speed" in args.parts else []
    report["comparisons"] = comparisons(report["speed"], peak)
    report["seconds"] = time.monotonic() - t0
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    failed = [r["case"] for r in report["checks"] if r.get("correct") is False]
    log(text)
    log(f"wrote {args.out}/report.md and report.json; {len(failed)} check(s) failed: {' '.join(failed)}")
    return report
