"""Reading compiled HLO: kernels by kind from each instruction's own op (never its operands' names), collective
bytes of asynchronous ops counted once, loop bodies times their trip count, a conditional's largest branch only,
and replica-group sizes in both of HLO's notations."""

from ptd_jax.analysis.hlo import (
    collective_summary,
    collectives_by_axes,
    device_groups,
    group_axes,
    group_size,
    hlo_kernels,
)

KERNELS = """
ENTRY %main (p: bf16[8,8]) -> bf16[8,8] {
  %gemm_fusion_dot.1 = bf16[8,8]{1,0} fusion(%p, %p), kind=kCustom, calls=%c1, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %loop_reduce_fusion = f32[8]{0} fusion(%gemm_fusion_dot.1), kind=kInput, calls=%c2
  %pallas_call.7 = bf16[8,8]{1,0} custom-call(%loop_reduce_fusion), custom_call_target="__gpu$xla.gpu.triton"
  %cublas.1 = bf16[8,8]{1,0} custom-call(%p), custom_call_target="__cublas$gemm"
  ROOT %add = bf16[8,8]{1,0} add(%pallas_call.7, %cublas.1)
}

%fused (p: f32[4]) -> f32[4] {
  ROOT %loop_fusion.2 = f32[4]{0} fusion(%p), kind=kLoop, calls=%c3
}
"""


def test_kernels_are_classified_by_their_own_op():
    assert hlo_kernels(KERNELS) == {"cublas": 1, "fusion": 2, "pallas_triton": 1, "triton_gemm": 1}


COLLECTIVES = """
%body (x: bf16[4,4]) -> bf16[4,4] {
  %cp = (bf16[4,4]{1,0}, bf16[4,4]{1,0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %ag = (bf16[4,2]{1,0}, bf16[4,4]{1,0}) all-gather-start(%x), replica_groups=[4,2]<=[8], dimensions={1}
}

%small (y: f32[4]) -> f32[4] {
  ROOT %ar = f32[4]{0} all-reduce(%y), replica_groups={{0,1},{2,3}}, to_apply=%sum
}

%large (y: f32[4]) -> f32[4] {
  %ar1 = f32[4]{0} all-reduce(%y), replica_groups={{0,1},{2,3}}, to_apply=%sum
  ROOT %ar2 = f32[4]{0} all-reduce(%ar1), replica_groups={{0,1},{2,3}}, to_apply=%sum
}

ENTRY %main (p: bf16[4,4], q: f32[4], k: pred[]) -> f32[4] {
  %w = bf16[4,4]{1,0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %c = f32[4]{0} conditional(%k, %q, %q), true_computation=%small, false_computation=%large
}
"""


def test_collectives_count_runs_once_per_execution():
    got = collective_summary(COLLECTIVES)
    # the ring's tuple (operand, result) counts its result only: 4*4*2 bytes, five trips
    assert got["collective-permute"] == {"count": 5, "bytes": 5 * 32, "group_sizes": [0]}
    assert got["all-gather"] == {"count": 5, "bytes": 5 * 32, "group_sizes": [2]}
    # of the conditional's branches only the larger one (two all-reduces) runs
    assert got["all-reduce"] == {"count": 2, "bytes": 2 * 16, "group_sizes": [2]}


COMBINED = """
ENTRY %main (a: f32[16], b: bf16[32], c: f32[4096], d: f32[1024]) -> f32[4] {
  %ag = ((f32[16]{0}, bf16[32]{0}), (f32[128]{0}, bf16[256]{0})) all-gather-start(%a, %b), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %ar = (f32[4096]{0}, f32[1024]{0}) all-reduce-start(%c, %d), replica_groups=[1,8]<=[8], to_apply=%sum
}
"""


def test_combined_asynchronous_collectives_count_all_their_results():
    """XLA combines small all-gathers and all-reduces: a combined all-gather-start's results are a tuple inside the
    (operands, results) tuple; an all-reduce-start's result is its results."""
    got = collective_summary(COMBINED)
    assert got["all-gather"]["bytes"] == 128 * 4 + 256 * 2
    assert got["all-reduce"]["bytes"] == (4096 + 1024) * 4


def test_group_sizes_in_both_notations():
    assert group_size("{{0,1,2,3},{4,5,6,7}}") == 4
    assert group_size("[4,2]<=[2,4]T(1,0)") == 2
    assert group_size("") == 0


def test_collectives_are_attributed_to_the_mesh_axes_their_groups_span():
    sizes = {"data": 2, "pipe": 1, "context": 2, "tensor": 2}  # device i at unravel_index(i, (2, 1, 2, 2))
    assert device_groups("{{0,2},{1,3},{4,6},{5,7}}", 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert device_groups("[4,2]<=[8]", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert device_groups("[2,4]<=[2,4]T(1,0)", 8) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert device_groups("{}", 4) == [[0, 1, 2, 3]]
    assert group_axes(device_groups("{{0,2},{2,0},{1,3},{3,1}}", 8), sizes) == ("context",)  # a ring's pairs
    assert group_axes(device_groups("[4,2]<=[8]", 8), sizes) == ("tensor",)
    assert group_axes(device_groups("[2,4]<=[2,2,2]T(1,0,2)", 8), sizes) == ("data", "tensor")
    hlo = """ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  %a = f32[4] collective-permute(f32[4] %p), channel_id=1, source_target_pairs={{0,2},{2,0}}
  ROOT %b = f32[4] all-reduce(f32[4] %a), channel_id=2, replica_groups=[4,2]<=[8], to_apply=%add
}"""
    assert collectives_by_axes(hlo, sizes) == {
        "all-reduce@tensor": {"count": 1, "bytes": 16},
        "collective-permute@context": {"count": 1, "bytes": 16},
    }
