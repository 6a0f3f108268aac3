"""Compile every Triton kernel of an inductor output module for a GPU architecture on a machine without a
GPU, to find (and then minimise) a kernel that Triton fails to compile. Inductor writes each compiled
graph's module under its cache folder (``/tmp/torchinductor_<user>/<2 chars>/c<hash>.py``, the module named
in a compile error's traceback); bring it back from the GPU host and run here, with the same Triton version
as the host (``pip install triton==<version>``; the kernels import torch's inductor runtime helpers too):

    python eval/device/check_triton.py MODULE.py [--arch 90] [--warps 4]

Prints one line per kernel that fails (its decorator, name and the error's last line) and a count. The block
sizes a kernel takes as constants get fixed values (XBLOCK 16, R0_BLOCK 64, ...; persistent reductions
XBLOCK 4): enough to find a kernel that fails in Triton's passes, which is what this is for. A pass that
failed on an H200 (the rejection-states reduction in fsd_eagle.kernels' docstring) failed here the same way.
"""

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

KERNEL = re.compile(r"(\w+) = async_compile\.triton\('(\w+)', '''\n(.*?)''', device_str='cuda'\)", re.S)
BLOCKS = {"XBLOCK": 16, "YBLOCK": 16, "ZBLOCK": 1, "R0_BLOCK": 64, "R1_BLOCK": 16}


def kernels(module_text: str):
    """(decorator, name, source without the decorator, signature) of each Triton kernel in the module."""
    for match in KERNEL.finditer(module_text):
        name, body = match.group(2), match.group(3)
        found = re.search(r"@triton_heuristics\.(\w+)\(", body)
        signature = re.search(r"'signature': (\{.*?\})", body)
        if found is None or signature is None:
            continue
        source = re.sub(r"@triton_heuristics\.\w+\((.|\n)*?\n\)\n", "", body, count=1)
        yield found.group(1), name, source.replace("triton_helpers.set_driver_to_gpu()", ""), eval(signature.group(1))


def compile_kernel(name: str, source: str, signature: dict, persistent: bool, arch: int, warps: int, folder: Path):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    constants = {k: (4 if persistent and k == "XBLOCK" else BLOCKS.get(k, 16))
                 for k, v in signature.items() if v == "constexpr"}
    triton.compile(ASTSource(getattr(module, name), signature=signature, constexprs=constants),
                   target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": 1, "debug": True})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("module")
    p.add_argument("--arch", type=int, default=90, help="compute capability (90: H100 and H200)")
    p.add_argument("--warps", type=int, default=4)
    a = p.parse_args()
    failed = total = 0
    with tempfile.TemporaryDirectory() as tmp:
        for decorator, name, source, signature in kernels(Path(a.module).read_text()):
            total += 1
            try:
                compile_kernel(name, source, signature, decorator == "persistent_reduction", a.arch, a.warps,
                               Path(tmp))
            except Exception as e:  # noqa: BLE001 - every failure is a finding, reported on one line
                failed += 1
                last = (str(e).strip().splitlines() or [""])[-1][:200]
                print(f"FAIL {decorator} {name}: {type(e).__name__}: {last}", flush=True)
    print(f"{a.module}: {total} kernels, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
