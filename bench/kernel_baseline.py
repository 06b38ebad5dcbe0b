"""Another checkout's Triton kernel modules loaded beside this checkout's, so a benchmark can time the
kernels before and after a change in one process (`--baseline ROOT` of bench/moe_decode_kernel.py,
bench/decode_fusions.py, bench/quant_linear_kernel.py, bench/gdn_decode_kernel.py,
bench/qsa_decode_select.py and bench/mtp_input_kernel.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

QUANT_LINEAR = "tierlm.kernels.quant_linear.triton"
SIBLINGS = {"fused_moe": ("decode_parts", "packed_decode")}  # an op's kernel modules its triton.py imports


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise SystemExit(f"--baseline: no kernel module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_baseline(root: Path, op: str) -> ModuleType:
    """root/tierlm/kernels/<op>/triton.py as a module of its own; its imports of quant_linear's kernels
    and of its op's sibling kernel modules (fused_moe's packed_decode, decode_parts) resolve to root's
    copies of them (the rest of tierlm is this checkout's)."""
    kernels = root / "tierlm" / "kernels"
    quant_linear = _load("baseline_quant_linear_triton", kernels / "quant_linear" / "triton.py")
    if op == "quant_linear":
        return quant_linear
    import tierlm.kernels.quant_linear  # noqa: F401  (the parent package, this checkout's)

    importlib.import_module(f"tierlm.kernels.{op}")  # (the op's package, this checkout's)
    saved = {name: sys.modules.get(name) for name in [QUANT_LINEAR, *(f"tierlm.kernels.{op}.{sibling}"
                                                                      for sibling in SIBLINGS.get(op, ()))]}
    try:
        sys.modules[QUANT_LINEAR] = quant_linear
        for sibling in SIBLINGS.get(op, ()):  # in dependency order
            path = kernels / op / f"{sibling}.py"
            if path.is_file():
                sys.modules[f"tierlm.kernels.{op}.{sibling}"] = _load(f"baseline_{op}_{sibling}", path)
        return _load(f"baseline_{op}_triton", kernels / op / "triton.py")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_baseline_module(root: Path, relative: str) -> ModuleType:
    """root/<relative> (a kernel module whose own imports of tierlm resolve to this checkout's) as a module
    of its own; `root` may also be that file itself (a copy of it, e.g. from `git show`)."""
    path = root if root.is_file() else root / relative
    return _load(f"baseline_{path.stem}", path)
