"""The environment-variable checks of `steadyload doctor` (``env.<VAR>`` lines).

Variables known to hurt training: ``HSA_OVERRIDE_GFX_VERSION`` on a GPU that torch supports
natively, TunableOp tuning, ``CUDA_LAUNCH_BLOCKING``. Pure functions of their inputs, like
`_doctor_checks`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ._doctor_checks import Check, Status


def gfx_from_override(value: str) -> str | None:
    """``HSA_OVERRIDE_GFX_VERSION`` to the gfx name it claims: "11.0.0" -> "gfx1100"."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", value.strip())
    return f"gfx{int(m[1])}{int(m[2]):x}{int(m[3]):x}" if m else None


def check_hsa_override(value: str, hip: str | None, device_archs: Sequence[str],
                       arch_list: Sequence[str] | None) -> Check:
    """``HSA_OVERRIDE_GFX_VERSION`` against the GPUs' real archs and torch's kernels.

    FAIL when every GPU is supported natively and one is RDNA4 (gfx12xx: crashes with
    ROCm 7.2); WARN when natively supported otherwise, or when that cannot be told.
    """
    name = "env.HSA_OVERRIDE_GFX_VERSION"
    claimed = gfx_from_override(value) or value
    data = {"value": value, "hip": hip, "device_archs": list(device_archs),
            "arch_list": None if arch_list is None else list(arch_list)}
    if not hip:
        return Check(name, "OK", f"set to {value}, ignored (not a ROCm build of torch)",
                     data=data)
    fix = "unset HSA_OVERRIDE_GFX_VERSION (export -n, and remove it from .bashrc / the image)."
    built = {a.split(":")[0] for a in arch_list or ()}
    if not device_archs or arch_list is None:
        return Check(name, "WARN", f"set to {value} ({claimed}); could not tell whether the "
                     "GPU is supported natively", data=data, fix="if `rocminfo | grep gfx` "
                     "shows a gfx name in torch.cuda.get_arch_list(), " + fix,
                     why="on a GPU torch has kernels for, the override only makes the runtime "
                     "load kernels built for another GPU.")
    native = [a for a in device_archs if a.split(":")[0] in built]
    if len(native) < len(device_archs):
        missing = ", ".join(a for a in device_archs if a not in native)
        return Check(name, "OK", f"set to {value} ({claimed}) for {missing}, which this torch "
                     "build has no kernels for", data=data)
    status: Status = "FAIL" if any(a.startswith("gfx12") for a in native) else "WARN"
    return Check(name, status, f"set to {value} ({claimed}), but torch (HIP {hip}) supports "
                 f"{', '.join(native)} natively", data=data, fix=fix,
                 why="the override makes the runtime load kernels built for another GPU; on "
                 "RDNA4 (gfx12xx) with ROCm 7.2 that crashes at the first kernel.")


def check_env(env: Mapping[str, str], hip: str | None = None,
              device_archs: Sequence[str] = (), arch_list: Sequence[str] | None = None,
              ) -> list[Check]:
    """Environment variables known to hurt training; one OK line when none is set."""
    checks = []
    if "HSA_OVERRIDE_GFX_VERSION" in env:
        checks.append(check_hsa_override(env["HSA_OVERRIDE_GFX_VERSION"], hip, device_archs,
                                         arch_list))
    if env.get("PYTORCH_TUNABLEOP_ENABLED", "0") not in ("", "0") and env.get(
            "PYTORCH_TUNABLEOP_TUNING", "1") != "0":
        checks.append(Check(
            "env.PYTORCH_TUNABLEOP_ENABLED", "WARN", "TunableOp tuning is on",
            data={"value": env["PYTORCH_TUNABLEOP_ENABLED"]},
            why="TunableOp benchmarks every new GEMM shape before using it: minutes of tuning "
            "at start (and again for each new sequence length) for a few percent at best.",
            fix="unset PYTORCH_TUNABLEOP_ENABLED; or tune once, then run with "
            "PYTORCH_TUNABLEOP_TUNING=0 to reuse the results file."))
    if env.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        checks.append(Check(
            "env.CUDA_LAUNCH_BLOCKING", "WARN", "every GPU kernel launch waits for the kernel",
            data={"value": env["CUDA_LAUNCH_BLOCKING"]},
            why="the CPU stops queueing work ahead of the GPU, so the GPU idles between "
            "kernels: several times slower. It is a debugging switch (exact error lines).",
            fix="unset CUDA_LAUNCH_BLOCKING once the error is found."))
    if checks:
        return checks
    debug = sorted(k for k in env if k.startswith("STEADYLOAD_"))
    return [Check("env", "OK", "no known-harmful variables set" + (
        f"; steadyload switches: {', '.join(debug)}" if debug else ""), data={"steadyload": debug})]
