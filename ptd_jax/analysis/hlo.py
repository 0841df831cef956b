"""What a compiled XLA:GPU program launches, read from its HLO text: kernels by kind, and the collectives with
their group sizes and bytes (`collectives.hlo_collectives` does the counting) in a JSON-friendly form."""

from __future__ import annotations

import re
from collections import Counter

from ptd_jax.analysis.collectives import hlo_collectives

_CUSTOM_CALL = re.compile(r' custom-call\(.*custom_call_target="([^"]+)"')
_FUSION = re.compile(r"^(?:ROOT )?\S+ = .*? fusion\(")
_FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')


def _kernel_kind(line: str) -> str | None:
    """The kind of kernel one HLO instruction launches, from its own op and backend configuration (never from its
    operands' names), or None for an instruction that launches none."""
    call = _CUSTOM_CALL.search(line)
    if call:
        target = call.group(1)
        if target == "__gpu$xla.gpu.triton":
            return "pallas_triton"
        if target.startswith("__cublas"):
            return "cublas"
        if target.startswith("__cudnn"):
            return "cudnn"
        return f"custom_call:{target}"
    if not _FUSION.match(line):
        return None
    kind = _FUSION_KIND.search(line)
    backend = kind.group(1) if kind else ""
    if "gemm" in backend:
        return "triton_gemm"
    if backend.startswith("__cudnn"):
        return "cudnn"
    return "fusion"


def hlo_kernels(hlo_text: str) -> dict[str, int]:
    """{kind: number of kernel ops in the program} — pallas_triton (our Pallas kernels, lowered by Triton),
    triton_gemm (XLA's own Triton matmul fusions), cublas, cudnn, fusion (XLA's elementwise/reduction fusions),
    custom_call:<target> for anything else. Static counts: a loop body's kernel counts once."""
    kinds = Counter(kind for line in hlo_text.splitlines() if (kind := _kernel_kind(line.strip())) is not None)
    return dict(sorted(kinds.items()))


def group_size(replica_groups: str) -> int:
    """Devices per group of an HLO `replica_groups` attribute: explicit `{{0,1},{2,3}}` or iota `[4,2]<=[8]`."""
    explicit = re.match(r"\{\{([\d,]*)\}", replica_groups)
    if explicit:
        return len([x for x in explicit.group(1).split(",") if x])
    iota = re.match(r"\[([\d,]+)\]", replica_groups)
    if iota:
        return int(iota.group(1).split(",")[-1])
    return 0  # no groups: all devices (`source_target_pairs` for a collective-permute)


def collective_summary(hlo_text: str) -> dict[str, dict]:
    """{op: {"count", "bytes", "group_sizes"}} per execution of the program (loop bodies times their trip count)."""
    return {
        op: {
            "count": entry["count"],
            "bytes": entry["bytes"],
            "group_sizes": sorted({group_size(g) for g in entry["replica_groups"]}),
        }
        for op, entry in sorted(hlo_collectives(hlo_text).items())
    }
