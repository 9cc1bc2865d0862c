"""Entry point: python -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml

Temporary stub: parses, validates and records the config; the GRPO loop lands
here later. Keep heavy imports (torch, vLLM) inside main() after parse_args so
that --help and config errors stay instant.
"""

from pathlib import Path

from torchtitan_rl.config import parse_args, write_toml


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)  # exits 2 with one "config error: ..." line on bad input
    out = Path(cfg.job.output_dir)
    write_toml(cfg, out / "config.toml")
    print(f"torchtitan_rl: resolved config written to {out / 'config.toml'}")
    print("torchtitan_rl: training loop not yet implemented")


if __name__ == "__main__":
    main()
