"""`check`: what `load_checkpoint` will do with a checkpoint, and every problem that would stop it,
from its config.json, index and safetensors headers alone (no tensor data read).

The report is the loader's own dry run (`checkpoint.plan_load`), so the two cannot disagree: the
stored tensors the parameters are read from, those skipped and why (the MTP layer, the vision
tower), the float8 weights paired with their block scales, bytes by dtype, and the bytes each device
holds under a layout, worked out from the sharding rules without the layout's devices.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np

from .config import Config
from .params import param_axes, param_shapes, spec_shapes, tree_bytes
from .quantization import QuantizationConfig, describe


def size(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} bytes"


@dataclasses.dataclass
class CheckReport:
    path: str
    config: Config
    quantization: QuantizationConfig | None
    files: int
    file_bytes: int  # the shards' sizes on disk, as their lengths say
    tensors: int  # stored tensors, scales included
    loaded: tuple[int, int]  # stored tensors the parameters read: (count, bytes)
    skipped: dict[str, tuple[int, int]]  # reason -> (count, bytes); scales apart
    scales: int  # float8 weights paired with their weight_scale_inv
    by_dtype: dict[str, tuple[int, int]]  # stored tensors' dtype -> (count, bytes)
    dtype: str  # of the loaded parameters (fp32 islands aside)
    param_bytes: int  # the loaded parameter tree
    layout: str | None
    device_bytes: int | None  # the loaded parameters a device holds under the layout
    device_bytes_float8: int | None  # the same with float8 weights kept as stored (weights="checkpoint")
    problems: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self):
        c = self.config
        kda, dense = c.layer_types.count("linear_attention"), c.mlp_layer_types.count("dense")
        n = c.num_nextn_predict_layers
        mtp = "" if n is None else f", {n} MTP layer{'' if n == 1 else 's'}"
        skipped = "".join(f", {n:,} skipped: {reason} ({size(b)})" for reason, (n, b) in sorted(self.skipped.items()))
        lines = [
            f"checkpoint {self.path}",
            f"  config:       {c.num_hidden_layers} layers ({kda} KDA, {c.num_hidden_layers - kda} DSA; {dense} dense MLP, "
            f"{c.num_hidden_layers - dense} MoE){mtp}, hidden {c.hidden_size}, {c.n_routed_experts} experts",
            f"  quantization: {describe(self.quantization)}",
            f"  files:        {self.files} safetensors, {size(self.file_bytes)} (headers read, no tensor data)",
            f"  tensors:      {self.tensors:,}: {self.loaded[0]:,} loaded ({size(self.loaded[1])}){skipped}"
            + (f", {self.scales:,} block scales, each with its float8 weight" if self.scales else ""),
            "  by dtype:     " + ", ".join(f"{d} {n:,} ({size(b)})" for d, (n, b) in self.by_dtype.items()),
            f"  parameters:   {size(self.param_bytes)} as loaded in {self.dtype}",
        ]
        if self.device_bytes is not None:
            lines.append(f"  per device:   {size(self.device_bytes)} under {self.layout}"
                         + (f" ({size(self.device_bytes_float8)} with the float8 weights kept as stored)"
                            if self.scales else ""))
        lines.append(f"  problems:     {len(self.problems) or 'none'}")
        lines += [f"    - {p}" for p in self.problems]
        lines.append(f"  checked in {self.seconds:.1f} s")
        return "\n".join(lines)


def summarise(plan, layout, dtype, start: float) -> CheckReport:
    """The report of a `checkpoint.LoadPlan`: counts and bytes from the headers, bytes a device from
    the layout's rules (an abstract mesh serves: no device is used)."""
    files, config = plan.files, plan.config
    names = list(files.names())
    by_dtype = collections.defaultdict(lambda: [0, 0])
    for name in names:
        entry = by_dtype[files.dtype(name)]
        entry[0] += 1
        entry[1] += files.nbytes(name)
    loaded = plan.loaded()
    skipped = {reason: (len(ns), sum(files.nbytes(n) for n in ns if n in files)) for reason, ns in plan.skipped.items()}
    shapes = param_shapes(config, dtype)
    problems = list(plan.problems)
    device, device_float8 = None, None
    if layout is not None:
        from .sharding import device_bytes, indivisible, layout_param_spec, placed

        forms = {False: "", True: " (float8 weights kept, with their block scales)"} if plan.scales else {False: ""}
        held = {}
        for fp8, form in forms.items():
            tree = placed(spec_shapes(layout_param_spec(config, layout, fp8), dtype), param_axes(config, fp8), layout)
            split = indivisible(tree, _shardings(tree))
            problems += [f"sharding under {layout.name}{form} does not divide: {p}" for p in split]
            held[fp8] = None if split else device_bytes(tree)
        device, device_float8 = held[False], held.get(True)
    return CheckReport(
        path=plan.path, config=config, quantization=plan.quantization, files=len(files.files),
        file_bytes=files.file_bytes(), tensors=len(names) + len(files.unavailable),
        loaded=(len(loaded), sum(files.nbytes(n) for n in loaded)), skipped=skipped, scales=len(plan.scales),
        by_dtype={str(d): tuple(v) for d, v in sorted(by_dtype.items(), key=lambda kv: -kv[1][1])}, dtype=str(np.dtype(dtype)),
        param_bytes=tree_bytes(shapes),
        layout=None if layout is None else _layout_name(layout), device_bytes=device, device_bytes_float8=device_float8,
        problems=problems, seconds=time.perf_counter() - start,
    )


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _layout_name(layout) -> str:
    sizes = [layout.mesh.shape[a] for a in ("data", "expert", "model")]
    n = int(np.prod(sizes))
    return f"{layout.name}:{'x'.join(map(str, sizes)) if layout.name == '3d' else n}"
