"""What a checkpoint manifest costs: checksum throughput over a freshly written file (page cache hot, as right
after a save), per algorithm, and the fsync. trainer/checkpoint.py uses zlib.crc32.

    python scripts/bench_checkpoint_manifest.py --mb 512
"""

import argparse
import hashlib
import os
import tempfile
import time
import zlib
from pathlib import Path

from bench_common import write_section

CHUNK = 8 << 20


def stream(path: Path, update) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            update(chunk)


def crc32(path: Path) -> None:
    crc = 0

    def update(chunk):
        nonlocal crc
        crc = zlib.crc32(chunk, crc)

    stream(path, update)


def hashed(name: str):
    def run(path: Path) -> None:
        h = hashlib.new(name)
        stream(path, h.update)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=512, help="size of the test file in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = args.mb << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.distcp"
        with open(path, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        start = time.perf_counter()
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        fsync_s = time.perf_counter() - start
        rows = []
        for name, fn in (("zlib.crc32 (used)", crc32), ("zlib.adler32", None), ("hashlib.sha256", hashed("sha256")),
                         ("hashlib.blake2b", hashed("blake2b")), ("hashlib.md5", hashed("md5"))):
            if fn is None:
                fn = lambda p: stream(p, zlib.adler32)  # noqa: E731
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn(path)
                times.append(time.perf_counter() - start)
            best = min(times)
            rows.append(f"| {name} | {size / best / 1e9:.2f} | {7.2e9 / (size / best):.1f} |")
    body = (
        f"Checksum of a {args.mb} MiB file just written (page cache hot), best of {args.repeats}, one core; "
        f"the fsync of that file took {fsync_s:.2f} s. A checkpoint's files are summed by all ranks, each "
        "a share, so a rank pays its own bytes. Qwen3-0.6B with AdamW in fp32 is 7.2 GB (weights + 2 moments).\n\n"
        "| checksum | GB/s | s for 7.2 GB on one rank |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    write_section("Checkpoint manifest cost (cpu)", device="cpu", body=body)


if __name__ == "__main__":
    main()
