"""Every check that needs a GPU, in order of value, run within one device call and resumed in the next.

    bash tools/gpu/all.sh                        # as many items as fit in BUDGET seconds (default 540)
    python -m tools.gpu_queue --list             # the items, their estimated cost and what is done
    python -m tools.gpu_queue --only grid,e2e    # just these (in queue order)

A call runs the items in order, skips those the state marks done or failed, and starts one only while
its estimated cost fits in what is left of ``--budget``; each runs under its own time limit (its cost
plus a margin) and is interrupted with SIGINT there, so pytest and the benchmarks still write what they
finished. Outcomes: ``done`` (exit 0), ``failed`` (another exit code: not retried unless
``--retry-failed``, since it would fail again; its logs say why), ``partial`` (cut by a time limit:
runs again next time).

Each item writes into ``$OUT/<item>/``; afterwards that folder is packed into ``$OUT/<item>.tgz``, so
one call brings back ``gpu_queue_state.json``, ``gpu_queue.log`` and one archive per item (the device
tool returns at most 8 files). To resume, copy the returned state to ``gpu_queue_state.json`` in the
working tree (untracked files travel) and run the same command: the default ``--state`` reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time
from typing import Optional

from flash_inductor import cli_args
from flash_inductor.text_table import text_table

PROG = "python -m tools.gpu_queue"
STATE_NAME = "gpu_queue_state.json"
MARGIN = 45  # seconds an item may run past its cost before it is interrupted (its own limits come first)


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    command: str  # bash; $OUT is the item's own folder, $LIMIT its cost in seconds
    cost: int  # estimated seconds on one H100/H200, warm machine, 14 pytest workers
    what: str


# The GPU suite first (a kernel change that has not passed it does not stay on), then the measurements
# the issues and docs cite. Costs: the suite took ~19 min on an H200 in 14 workers (2026-12-04), the
# fuller model matrices included from 2026-12-07.
ITEMS = (
    *(Item(f"suite-{i}of3", f"SHARD={i}/3 SKIP_BENCH=1 SUITE_SECONDS=$LIMIT bash tools/gpu/suite.sh", 480,
           f"the GPU test suite, shard {i} of 3") for i in (1, 2, 3)),
    Item("varlen-trial", "VARLEN_SECONDS=$((LIMIT - 160)) bash tools/gpu/steps.sh varlen_trial", 360,
         "the held Gluon packed-sequence tests (launch/hopper_varlen.NOT_YET_ON_A_GPU), sanitizer on a fault"),
    Item("varlen-host-table", "FLASH_INDUCTOR_GLUON_VARLEN_TRIAL=1 REV=varlen-host-table SUITE_SECONDS=$((LIMIT - 20)) "
         "TESTS='tests/unit/test_kernels_varlen.py -k gluon' bash tools/gpu/steps.sh rev_tests", 240,
         "branch varlen-host-table (each block's sequence from a host-built table): the held Gluon packed tests"),
    Item("softcap-spills", "REV=softcap-spills SUITE_SECONDS=$((LIMIT - 20)) TESTS='tests/unit/test_kernels_softcap.py "
         "tests/unit/test_hopper_bwd.py -k softcap' bash tools/gpu/steps.sh rev_tests", 240,
         "branch softcap-spills (the Gluon backward's soft cap with fewer spills): its GPU tests, before a merge"),
    Item("stability-variants", "PARTS=variants PART_SECONDS=$((LIMIT - 80)) bash tools/gpu/steps.sh stability", 280,
         "the adversarial suite's soft-cap, sinks and packed cases (README, Stability; docs/variants.md)"),
    Item("memcheck", "MEMCHECK_SECONDS=$((LIMIT - 60)) bash tools/gpu/steps.sh memcheck", 480,
         "the address tests under compute-sanitizer (the suite skips them on a GPU)"),
    Item("grid", "BUDGET=$LIMIT bash tools/gpu/steps.sh grid", 540,
         "the speed grid against cuDNN, FA2 and Flex (README, Performance)"),
    Item("e2e", "python3 -m benchmarks.e2e_models --time-budget $((LIMIT - 30)) --out $OUT", 540,
         "real models: plain torch.compile against flash_inductor (README, End to end)"),
    Item("variants", "bash tools/gpu/steps.sh variants", 260, "packed, sinks and soft-cap speed (docs/variants.md)"),
    Item("refactor-ab", "REV=bbc7e6a BUDGET=$((LIMIT - 40)) bash tools/gpu/steps.sh ab", 440,
         "the Gluon kernels before issue 60's refactor (bbc7e6a) against this tree, the 4k/16k grid"),
    Item("cold", "bash tools/gpu/steps.sh cold", 320, "the cold start of a Llama step"),
)


@dataclasses.dataclass
class Outcome:
    state: str  # done, failed, partial
    seconds: float
    rc: Optional[int]
    when: str


def load_state(path: pathlib.Path) -> dict[str, Outcome]:
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {name: Outcome(**fields) for name, fields in raw["items"].items()}
    except (ValueError, KeyError, TypeError) as error:
        raise cli_args.UsageError(f"--state {path}: not a {STATE_NAME} written by this tool ({error}); "
                                  "delete it to start the queue afresh") from None


def save_state(path: pathlib.Path, outcomes: dict[str, Outcome]) -> None:
    path.write_text(json.dumps({"items": {n: dataclasses.asdict(o) for n, o in outcomes.items()}}, indent=1) + "\n")


def pending(items, outcomes: dict[str, Outcome], retry_failed: bool) -> list[Item]:
    """The items still to run, in queue order."""
    finished = {"done"} if retry_failed else {"done", "failed"}
    return [item for item in items if outcomes.get(item.name) is None or outcomes[item.name].state not in finished]


def _default_sigint() -> None:
    """In the item's process before it starts: SIGINT back to its default. An ignored SIGINT is
    inherited (a parent under nohup, a pytest-xdist worker), and a shell cannot trap a signal that
    was ignored on entry, so the item would run on past its limit until the SIGKILL 30 s later."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_item(item: Item, out: pathlib.Path, log) -> Outcome:
    """Runs one item under its limit; SIGINT (then SIGKILL 30 s later) to its process group at the limit."""
    folder = out / item.name
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OUT=str(folder), LIMIT=str(item.cost))
    start = time.monotonic()
    process = subprocess.Popen(["bash", "-c", item.command], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, preexec_fn=_default_sigint)
    try:
        rc = process.wait(timeout=item.cost + MARGIN)
        cut = rc in (124, 130, 137)  # timeout(1)'s codes and SIGINT's: an inner limit stopped it
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        rc, cut = None, True
    with tarfile.open(out / f"{item.name}.tgz", "w:gz") as archive:
        archive.add(folder, arcname=item.name)
    state = "partial" if cut else ("done" if rc == 0 else "failed")
    return Outcome(state, round(time.monotonic() - start, 1), rc, time.strftime("%Y-%m-%d %H:%M:%S"))


def run_queue(items, out: pathlib.Path, state_in: pathlib.Path, budget: float, retry_failed: bool = False,
              say=print) -> dict[str, Outcome]:
    """Runs what fits of the pending items; returns every item's outcome so far (the state it saves)."""
    outcomes = load_state(state_in)
    start = time.monotonic()
    with open(out / "gpu_queue.log", "a") as log:
        for item in pending(items, outcomes, retry_failed):
            left = budget - (time.monotonic() - start)
            if item.cost > left:
                say(f"{item.name}: needs ~{item.cost} s, {left:.0f} s left; next call")
                break  # in order of value: a later, cheaper item does not jump the queue
            say(f"{item.name}: {item.what} (~{item.cost} s)")
            log.write(f"==== {item.name}: {item.command}\n")
            log.flush()
            outcomes[item.name] = run_item(item, out, log)
            save_state(out / STATE_NAME, outcomes)
            o = outcomes[item.name]
            say(f"{item.name}: {o.state} in {o.seconds:.0f} s (rc {o.rc})")
    save_state(out / STATE_NAME, outcomes)
    return outcomes


def format_items(items, outcomes: dict[str, Outcome]) -> str:
    rows = [(item.name, f"{item.cost}", outcomes[item.name].state if item.name in outcomes else "-", item.what)
            for item in items]
    return "\n".join(text_table(rows, header=("item", "cost s", "state", "what"), rule="columns"))


def parse_args(argv=None):
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=cli_args.seconds, default=540.0, help="seconds for this call (default 540)")
    p.add_argument("--only", help=f"comma-separated items (default: all): {', '.join(i.name for i in ITEMS)}")
    p.add_argument("--state", default=STATE_NAME, help=f"the previous call's state (default ./{STATE_NAME})")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/flash_inductor_out"))
    p.add_argument("--retry-failed", action="store_true", help="run failed items again")
    p.add_argument("--list", action="store_true", help="show the queue and the state, run nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    items = list(ITEMS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        chosen = set(cli_args.known_names("--only", names, [i.name for i in items]))
        items = [i for i in items if i.name in chosen]
    state = pathlib.Path(args.state)
    if args.list:
        print(format_items(items, load_state(state)))
        return 0
    out = cli_args.output_dir("--out", args.out)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = run_queue(items, out, state, args.budget, args.retry_failed)
    print(format_items(items, outcomes))
    return 0 if all(outcomes.get(i.name) and outcomes[i.name].state == "done" for i in items) else 1


if __name__ == "__main__":
    sys.exit(cli_args.run(main, prog=PROG))
