"""Pipeline schedules and their tables: pure Python, golden tables, the paper's bubble, Megatron's stash, the
zero-bubble paper's promises, slot validity."""

import json
from pathlib import Path

import pytest

from ptd_jax.config import SCHEDULE_SPECS
from ptd_jax.parallel.pipeline import table as L
from ptd_jax.parallel.pipeline import schedule as S
from ptd_jax.cli.schedule import main as schedule_main

# megatron-core 0.16.1's per-rank order for p=4, v=2, m=8, G=4 (recorded by running its schedule; see
# golden/README.md).
GOLDEN = Path(__file__).resolve().parent / "golden" / "megatron_interleaved_p4_v2_m8.json"


def test_action_round_trip():
    for text in ("F0.3", "B12.0", "I2.1", "W1.7"):
        assert str(S.Action.parse(text)) == text
    with pytest.raises(S.ScheduleError, match="kind 'X'"):
        S.Action.parse("X0.1")


def test_interleaved_order_equals_megatron_core_golden():
    golden = json.loads(GOLDEN.read_text())
    orders = S.interleaved_orders(golden["p"], golden["v"], golden["m"], golden["G"])
    assert [[str(a) for a in order] for order in orders] == golden["ranks"]


def test_design_example_rank3():
    order = [str(a) for a in S.interleaved_orders(4, 2, 8, 4)[3]]
    assert order[:14] == "F0.0 F0.1 F0.2 F0.3 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 F0.4 B0.0".split()  # noqa: SIM905


@pytest.mark.parametrize(
    "p, v, m, g",
    [
        (2, 2, 4, None),
        (4, 2, 8, None),
        (4, 2, 16, None),
        (4, 3, 12, None),
        (8, 2, 16, None),
        (2, 4, 8, None),
        (4, 2, 16, 8),
        (3, 2, 9, None),
    ],
)
def test_interleaved_follows_megatrons_rule(p, v, m, g):
    """The rule of docs/architecture.md ("Megatron's interleaved order"), written independently: forward
    k -> chunk (k mod Gv)//G, microbatch (k//Gv)·G + k mod G; backward k -> chunk v−1−that; warm-up
    2(p−r−1) + (v−1)·G capped at m·v, then alternate one forward and one backward, then the remaining
    backwards."""
    G = g or p
    total = m * v

    def fwd(k):
        return S.F((k % (G * v)) // G, (k // (G * v)) * G + k % G)

    def bwd(k):
        f = fwd(k)
        return S.B(v - 1 - f.chunk, f.microbatch)

    for r, order in enumerate(S.interleaved_orders(p, v, m, G)):
        warm = min(2 * (p - r - 1) + (v - 1) * G, total)
        expected = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            expected += [fwd(warm + i), bwd(i)]
        expected += [bwd(k) for k in range(total - warm, total)]
        assert order == expected, f"rank {r}"


CASES = [(name, p, 1, m) for name in ("gpipe", "1f1b-lockstep") for p in (2, 4, 8) for m in (1, 3, 8, 16)] + [
    ("interleaved", p, v, m) for p in (2, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)
]


@pytest.mark.parametrize("name, p, v, m", CASES)
def test_lockstep_bubble_equals_the_paper_formula(name, p, v, m):
    """GPipe, 1F1B on lockstep rows and interleaved (fused backwards, one kind a tick): (p−1)/(v·m), for backward =
    2× and 3× forward."""
    assert SCHEDULE_SPECS[name].rows == "lockstep" and not SCHEDULE_SPECS[name].split
    sched = L.build(name, p, v, m)
    L.validate(sched)
    assert all(len(kinds) == 1 for kinds in sched.kinds)  # a lockstep row has one kind
    for k in (2.0, 3.0):
        assert sched.simulate(k)["bubble_fraction"] == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (3, 7), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24), (4, 2)])
def test_1f1b_holds_megatrons_stash(p, m):
    """Stage s holds min(p − s, m) microbatches between F and I (Megatron's warm-up p − 1 − s), each I followed at
    once by its W: its bubble at f = b = w is (p−1)(f+b)/(m(f+b+w)) = 2(p−1)/(3m)."""
    sched = L.build("1f1b", p, 1, m)
    L.validate(sched)
    assert sched.peak_stash == [min(p - s, m) for s in range(p)]
    assert sched.peak_in_flight == sched.peak_stash and sched.peak_w_stash == [1] * p
    assert sched.simulate(times=(1.0, 1.0, 1.0))["bubble_fraction"] == pytest.approx(2 * (p - 1) / (3 * m))


def test_1f1b_at_the_issues_case():
    assert L.build("1f1b", 4, 1, 8).peak_stash == [4, 3, 2, 1]


@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_lockstep_1f1b_holds_twice_the_warm_up(p, m):
    """1F1B on lockstep rows (fused B, warm-up 2(p − 1 − s)): stage s holds min(2(p − 1 − s) + 1, m) microbatches,
    nothing waits for a W, and neighbouring stages want the same kind in each tick."""
    sched = L.build("1f1b-lockstep", p, 1, m)
    L.validate(sched)
    assert sched.peak_stash == [min(2 * (p - 1 - s) + 1, m) for s in range(p)]
    assert sched.peak_in_flight == sched.peak_stash and sched.slots["hold"] == sched.slots["w"] == 0
    assert set(sched.kinds) <= {"F", "B"}


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (4, 16), (8, 16), (3, 6)])
def test_zero_bubble_tables_keep_their_promises(p, m):
    """At f = b = w: ZB-H1 at most half of 1F1B's bubble (and the paper's (p−1)(f+b−w)/(m(f+b+w))), holding at most
    p microbatches from F until W; ZB-V at most a quarter of 1F1B's bubble, holding at most 1F1B's layer-microbatches
    (chunk-microbatches / 2) from F until W."""
    times = (1.0, 1.0, 1.0)
    one_f_one_b = L.build("1f1b", p, 1, m)
    bubble = one_f_one_b.simulate(times=times)["bubble_fraction"]
    h1 = L.build("zb-h1", p, 1, m)
    L.validate(h1)
    assert h1.simulate(times=times)["bubble_fraction"] <= bubble / 2 + 1e-12
    assert h1.simulate(times=times)["bubble_fraction"] == pytest.approx(h1.formula_bubble(times))
    assert max(h1.peak_in_flight) <= p
    zbv = L.build("zb-v", p, 2, m)
    L.validate(zbv)
    assert zbv.simulate(times=times)["bubble_fraction"] <= bubble / 4 + 1e-12
    assert max(zbv.peak_in_flight) / 2 <= max(one_f_one_b.peak_in_flight)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16), (2, 4)])
def test_zero_bubble_at_the_issues_cases(p, m):
    """f = b = w: ZB-H1's bubble at most half of 1F1B's with at most p in flight; ZB-V's at most 0.1 with at most
    1F1B's layer-microbatches in flight (chunk-microbatches / v). (At m = p ZB-V's bubble is above 0.1: 0.125 at
    p = m = 4.)"""
    times = (1.0, 1.0, 1.0)
    one_f_one_b = L.build("1f1b", p, 1, m)
    h1 = L.build("zb-h1", p, 1, m)
    assert h1.simulate(times=times)["bubble_fraction"] <= 0.5 * one_f_one_b.simulate(times=times)["bubble_fraction"]
    assert max(h1.peak_in_flight) <= p
    zbv = L.build("zb-v", p, 2, m)
    assert zbv.simulate(times=times)["bubble_fraction"] <= 0.1
    assert max(zbv.peak_in_flight) / zbv.v <= max(one_f_one_b.peak_in_flight) == p


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 2, 16), (2, 2, 8), (8, 2, 16), (4, 4, 16)])
def test_peak_stash(p, v, m):
    """Interleaved stage 0 holds min(p·v + p − 1, m·v) chunk inputs (docs/architecture.md, "Pipeline"), GPipe m."""
    assert L.build("interleaved", p, v, m).peak_stash[0] == min(p * v + p - 1, m * v)
    assert L.build("gpipe", p, 1, m).peak_stash == [m] * p


@pytest.mark.parametrize(
    "name, p, v",
    [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("interleaved", 2, 3), ("1f1b", 8, 1), ("zb-v", 4, 2)],
)
def test_evaluation_slots_do_not_grow_with_m(name, p, v):
    """A table of forwards only frees an input once its forward has read it and keeps no record: a few activation
    slots per rank whatever m, where training holds the stash. Each read still finds its own input (`validate`)."""
    slots = set()
    for m in (8, 32, 64):
        sched = L.build_forward_only(name, p, v, m)
        L.validate(sched)
        assert sched.forward_only and set(sched.kinds) == {"F"}
        assert sched.slots["rec"] == sched.slots["hold"] == sched.slots["w"] == 0
        slots.add(sched.slots["act"])
    assert len(slots) == 1 and slots.pop() <= 3


def test_validator_catches_a_broken_schedule():
    sched = L.build("1f1b", 4, 1, 8)
    row = next(t for t, row in enumerate(sched.cells) if row[0].action is not None and row[0].action.kind == "I")
    sched.cells[row][0].rec_slot = (sched.cells[row][0].rec_slot + 1) % sched.slots["rec"]
    with pytest.raises(S.ScheduleError, match="reads rec slot"):
        L.validate(sched)
    early = L.build("gpipe", 2, 1, 2)
    early.cells[0][1].action = S.F(0, 0)  # rank 1 cannot run F0.0 before rank 0 finished it
    early.cells[1][1].action = None
    with pytest.raises(S.ScheduleError, match="before its dependency"):
        L.validate(early)


def test_validator_catches_w_slots_swapped_and_an_action_run_twice():
    """Two of the last rank's W's reading each other's taps (ZB-H1 defers up to p − 1 there), and a tick repeating
    rank 0's last W (its slots no longer held: the kernels' gradients would be added twice)."""
    sched = L.build("zb-h1", 4, 1, 8)
    w_cells = [row[3] for row in sched.cells if row[3].action is not None and row[3].action.kind == "W"]
    first, second = next((a, b) for a in w_cells for b in w_cells if a.w_slot != b.w_slot)
    first.w_slot, second.w_slot = second.w_slot, first.w_slot
    with pytest.raises(S.ScheduleError, match="reads w slot"):
        L.validate(sched)
    sched = L.build("zb-h1", 4, 1, 8)
    last_w = next(row[0] for row in reversed(sched.cells) if row[0].action is not None)
    assert last_w.action.kind == "W"
    sched.cells.append(
        [L.Cell(action=last_w.action, hold_slot=last_w.hold_slot, w_slot=last_w.w_slot)] + [L.Cell() for _ in range(3)]
    )
    with pytest.raises(S.ScheduleError, match="runs twice"):
        L.validate(sched)


def test_a_deadlocking_order_is_reported():
    orders = [[S.B(0, 0), S.F(0, 0)], [S.F(0, 0), S.B(0, 0)]]
    with pytest.raises(S.ScheduleError, match="deadlocks at tick 0"):
        L.place(SCHEDULE_SPECS["gpipe"], orders, 2, 1, 1)


@pytest.mark.parametrize(
    "args, message",
    [
        (("interleaved", 1, 2, 4), "needs p >= 2 pipeline ranks, got p=1"),
        (("interleaved", 4, 2, 2), "p <= G <= m (Megatron's rule), got p=4, G=4, m=2"),
        (("interleaved", 4, 2, 6), "m % G == 0 or m % G >= p"),
        (("1f1b", 4, 2, 8), "runs 1 model chunk(s) per rank: needs v=1, got v=2"),
        (("zb-v", 4, 1, 8), "runs 2 model chunk(s) per rank: needs v=2, got v=1"),
        (("zb", 4, 1, 8), "schedule='zb' is not one of"),
        (("1f1b-split", 4, 1, 8), "schedule='1f1b-split' is retired"),
    ],
)
def test_bad_requests(args, message):
    with pytest.raises(S.ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        L.build(*args)


def test_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert (
        schedule_main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "8", "--json", "--plot", str(png)]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {"schedule", "p", "v", "m", "ticks", "bubble_fraction", "formula_bubble", "peak_stash", "ranks"} <= set(out)
    assert out["bubble_fraction"] == pytest.approx(out["formula_bubble"]) and out["ticks"] == 38
    assert out["ranks"][3][:6] == ["F0.0", "F0.1", "F0.2", "F0.3", "F1.0", "B1.0"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert schedule_main(["--schedule", "interleaved", "-p", "4", "-m", "6"]) == 2
    assert "m % G == 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n, spec in SCHEDULE_SPECS.items() if spec.orders in L.RECORD_SLOTS])
def test_closed_form_record_slots_equal_the_tables(name):
    """`table.RECORD_SLOTS` (what the planner uses instead of building tables) equals the tables' pools."""
    spec = SCHEDULE_SPECS[name]
    checked = 0
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, p, 2 * p, 4 * p + 1):
            for v in (2, 3) if spec.chunks is None else (spec.chunks,):
                try:
                    table = L.build(name, p, v, m)
                except S.ScheduleError:
                    continue
                closed = L.RECORD_SLOTS[spec.orders](p, v, m, table.group, spec.split)
                if closed is not None:
                    assert closed == {k: table.slots[k] for k in closed}, (p, v, m)
                    checked += 1
    assert checked >= 12
