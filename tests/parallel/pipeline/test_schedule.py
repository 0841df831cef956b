"""Pipeline schedules: pure Python, golden tables, the paper's bubble, slot validity."""

import json
from pathlib import Path

import pytest

from ptd_jax.parallel.pipeline import lockstep as L
from ptd_jax.parallel.pipeline import schedule as S
from ptd_jax.cli.schedule import main as schedule_main

# megatron-core 0.16.1's per-rank order for p=4, v=2, m=8, G=4 (recorded by running its schedule; see
# golden/README.md).
GOLDEN = Path(__file__).resolve().parent / "golden" / "megatron_interleaved_p4_v2_m8.json"


def test_action_round_trip():
    for text in ("F0.3", "B12.0", "W1.7"):
        assert str(S.Action.parse(text)) == text
    with pytest.raises(S.ScheduleError, match="kind 'X'"):
        S.Action.parse("X0.1")


def test_interleaved_order_equals_megatron_core_golden():
    golden = json.loads(GOLDEN.read_text())
    orders = S.interleaved_orders(golden["p"], golden["v"], golden["m"], golden["G"])
    assert [[str(a) for a in order] for order in orders] == golden["ranks"]


def test_design_example_rank3():
    order = [str(a) for a in S.interleaved_orders(4, 2, 8)[3]]
    assert order[:14] == "F0.0 F0.1 F0.2 F0.3 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 F0.4 B0.0".split()  # noqa: SIM905


@pytest.mark.parametrize("p, v, m, g", [(2, 2, 4, None), (4, 2, 8, None), (4, 2, 16, None), (4, 3, 12, None),
                                        (8, 2, 16, None), (2, 4, 8, None), (4, 2, 16, 8), (3, 2, 9, None)])
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

    for r, order in enumerate(S.interleaved_orders(p, v, m, g)):
        warm = min(2 * (p - r - 1) + (v - 1) * G, total)
        expected = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            expected += [fwd(warm + i), bwd(i)]
        expected += [bwd(k) for k in range(total - warm, total)]
        assert order == expected, f"rank {r}"


CASES = ([("gpipe", p, 1, m) for p in (2, 4, 8) for m in (1, 3, 8, 16)]
         + [("1f1b", p, 1, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p + 1)]
         + [("interleaved", p, v, m) for p in (2, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)])


@pytest.mark.parametrize("name, p, v, m", CASES)
def test_lockstep_bubble_equals_the_paper_formula(name, p, v, m):
    """GPipe and 1F1B: (p−1)/m; interleaved: (p−1)/(v·m), for backward = 2× and 3× forward."""
    sched = L.build(name, p, v, m)
    L.validate(sched)
    for k in (2.0, 3.0):
        assert sched.simulate(k)["bubble_fraction"] == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 2, 16), (2, 2, 8), (8, 2, 16), (4, 4, 16)])
def test_peak_stash(p, v, m):
    """Stage 0 holds min(p·v + p − 1, m·v) chunk inputs interleaved (docs/architecture.md, "Pipeline"), GPipe m·v,
    1F1B in lockstep 2(p−1)+1."""
    assert L.build("interleaved", p, v, m).peak_stash[0] == min(p * v + p - 1, m * v)
    assert L.build("gpipe", p, 1, m).peak_stash == [m] * p
    assert L.build("1f1b", p, 1, m).peak_stash == [min(2 * (p - 1 - s) + 1, m) for s in range(p)]


@pytest.mark.parametrize("name, p, v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("interleaved", 2, 3),
                                         ("1f1b", 8, 1)])
def test_evaluation_slots_do_not_grow_with_m(name, p, v):
    """A table of forwards only frees a slot once its forward has read it (no backward will): two slots per rank
    (the one read this tick, the one arriving), whatever m, where holding every input until a B that never comes
    took m·v (64 at p=4, m=64, training's 1F1B 7). Each read still finds its own input (`validate`)."""
    slots = set()
    for m in (8, 32, 64):
        sched = L.build_forward_only(name, p, v, m)
        L.validate(sched)
        assert sched.forward_only and set(sched.kinds) == {"F"}
        assert sched.peak_stash == [1] * p
        slots.add(sched.num_act_slots)
    assert slots == {2}
    assert L.build_forward_only("1f1b", 4, 1, 64).num_act_slots < L.build("1f1b", 4, 1, 64).num_act_slots == 7


def test_validator_catches_a_broken_schedule():
    sched = L.build("1f1b", 4, 1, 8)
    row = next(t for t, kind in enumerate(sched.kinds) if kind == "B" and sched.cells[t][0].action is not None)
    sched.cells[row][0].in_slot = (sched.cells[row][0].in_slot + 1) % sched.num_act_slots
    with pytest.raises(S.ScheduleError, match="reads a stash slot"):
        L.validate(sched)
    early = L.build("gpipe", 2, 1, 2)
    early.cells[0][1].action = S.F(0, 0)  # rank 1 cannot run F0.0 before rank 0 finished it
    early.cells[1][1].action = None
    with pytest.raises(S.ScheduleError, match="before its dependency"):
        L.validate(early)


def test_a_deadlocking_order_is_reported():
    orders = [[S.B(0, 0), S.F(0, 0)], [S.F(0, 0), S.B(0, 0)]]
    with pytest.raises(S.ScheduleError, match="deadlocks at tick 0"):
        L.lockstep("bad", orders, 2, 1, 1, 1)


@pytest.mark.parametrize("args, message", [
    (("interleaved", 1, 2, 4), "interleaving needs p >= 2 pipeline ranks, got p=1"),
    (("interleaved", 4, 2, 2), "p <= G <= m (Megatron's rule), got p=4, G=4, m=2"),
    (("interleaved", 4, 2, 6), "m % G == 0 or m % G >= p"),
    (("1f1b", 4, 2, 8), "v=2 needs schedule='interleaved'"),
    (("zb", 4, 1, 8), "schedule='zb' is not one of"),
])
def test_bad_requests(args, message):
    with pytest.raises(S.ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        L.build(*args)


def test_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert schedule_main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "8", "--json",
                          "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"schedule", "p", "v", "m", "ticks", "bubble_fraction", "formula_bubble", "peak_stash", "ranks"} <= set(out)
    assert out["bubble_fraction"] == pytest.approx(out["formula_bubble"]) and out["ticks"] == 38
    assert out["ranks"][3][:6] == ["F0.0", "F0.1", "F0.2", "F0.3", "F1.0", "B1.0"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert schedule_main(["--schedule", "interleaved", "-p", "4", "-m", "6"]) == 2
    assert "m % G == 0" in capsys.readouterr().err
