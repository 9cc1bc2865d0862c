"""GPU machine check: versions, every torchtitan_rl module imports, the copy floor.

    python3 scripts/gpu/check_env.py
"""

import importlib
import pkgutil
import time

import torch


def main() -> None:
    import torchtitan_rl.compat  # noqa: F401  (before torchtitan)
    import torchtitan
    import vllm

    print(f"torch {torch.__version__}, vllm {vllm.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}")
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print(f"gpu {props.name}, {props.multi_processor_count} SMs, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free)")

    import torchtitan_rl

    failed = []
    for mod in pkgutil.walk_packages(torchtitan_rl.__path__, "torchtitan_rl."):
        try:
            importlib.import_module(mod.name)
        except Exception as e:  # report every missing dependency at once
            failed.append(f"{mod.name}: {type(e).__name__}: {e}")
    print("imports:", "all torchtitan_rl modules OK" if not failed else "\n  " + "\n  ".join(failed))

    # The bandwidth ceiling every sync number is compared with: 1 GiB flat copies.
    n = 1 << 28
    src32 = torch.randn(n, device="cuda")
    dst16 = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    src16 = src32.bfloat16()
    for name, fn, nbytes in (
        ("bf16 copy", lambda: dst16.copy_(src16), 4 * n),
        ("fp32->bf16 cast copy", lambda: dst16.copy_(src32), 6 * n),
    ):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = (time.perf_counter() - start) / 20
        print(f"{name}: {t * 1e3:.3f} ms for {n / 2**20:.0f} Mi elements -> {nbytes / t / 1e12:.2f} TB/s (read + write)")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
