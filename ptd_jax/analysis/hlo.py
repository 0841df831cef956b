"""What a compiled XLA:GPU program launches, read from its HLO text: kernels by kind, and the collectives with
their group sizes and bytes (`collectives.hlo_collectives` does the counting) in a JSON-friendly form, also by the
mesh axes each spans (`collectives_by_axes`: context parallelism's ring and gathers by name)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

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


def device_groups(groups: str, num_devices: int) -> list[list[int]]:
    """The device groups of an HLO `replica_groups` attribute (explicit `{{0,1},{2,3}}`, iota `[4,2]<=[8]` or
    `[2,4]<=[4,2]T(1,0)`; empty: every device) or of a `source_target_pairs` one (each pair a group)."""
    if groups.startswith("{"):
        found = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", groups)]
        return [g for g in found if g] or [list(range(num_devices))]
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", groups)
    if not iota:
        return [list(range(num_devices))]
    shape, dims = [int(x) for x in iota.group(1).split(",")], [int(x) for x in iota.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(3):
        ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
    return ids.reshape(-1, shape[-1]).tolist()


def group_axes(groups: list[list[int]], axis_sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of any group differ (device i at `np.unravel_index(i, sizes)`: the
    mesh's devices in order, as `parallel.mesh.make_mesh` and the virtual GPUs lay them out)."""
    names, sizes = list(axis_sizes), list(axis_sizes.values())
    varies = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes))  # [axes, members]
        varies |= {names[a] for a in range(len(names)) if len(set(coords[a])) > 1}
    return tuple(n for n in names if n in varies)


def collectives_by_axes(hlo_text: str, axis_sizes: dict[str, int]) -> dict[str, dict]:
    """{"op@axes": {"count", "bytes"}} per execution of the program: each collective of the compiled HLO attributed
    to the mesh axes its groups (or a collective-permute's pairs) span, e.g. "collective-permute@context" for
    context parallelism's ring; bytes are result bytes, as `collective_summary`'s."""
    n = int(np.prod(list(axis_sizes.values())))
    out: dict[str, dict] = {}
    for op, entry in hlo_collectives(hlo_text).items():
        for one in entry["ops"]:
            groups = one.get("source_target_pairs") or one["replica_groups"]
            key = f"{op}@{','.join(group_axes(device_groups(groups, n), axis_sizes)) or 'none'}"
            slot = out.setdefault(key, {"count": 0, "bytes": 0})
            slot["count"] += one["times"]
            slot["bytes"] += one["times"] * one["bytes"]
    return dict(sorted(out.items()))
