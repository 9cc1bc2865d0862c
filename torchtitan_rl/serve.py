"""The rollout server: TORCHTITAN_RL_SERVE_TOKEN=SECRET python -m torchtitan_rl.serve --config run_configs/cpu_tiny.toml

(the token from the environment, out of sight of `ps`; ``--serve.token`` works too, visible to every user.)

The same JobConfig as the trainer (model, generator, task for the tokenizer,
serve section). It serves nothing until a trainer started with
``--weight_sync.transport server`` (and the same serve section) connects and
syncs: serving/server.py says how. HTTPS with ``--serve.ssl_certfile`` and
``--serve.ssl_keyfile``. Stops on Ctrl-C / SIGTERM.
"""

from pathlib import Path

from torchtitan_rl import collector
from torchtitan_rl.run.exits import one_line_errors
from torchtitan_rl.config import parse_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    with one_line_errors():
        from torchtitan_rl.config.validation import check_serve

        check_serve(cfg)
        serve(cfg)


def serve(cfg) -> None:
    with collector.paused():  # start-up (collector.py)
        import uvicorn

        from torchtitan_rl.serving.engine_loop import EngineLoop
        from torchtitan_rl.engine.engine import Engine
        from torchtitan_rl.serving.http_limits import with_header_deadline
        from torchtitan_rl.serving.protocol import bind_gloo, check_server_tls, listen
        from torchtitan_rl.serving.server import RolloutServer, SyncSessions, tokenizer_folder
        from torchtitan_rl.run.parts import run_device, run_shape, run_task
        from transformers import AutoTokenizer

    # The port and the certificate first: a busy port or a bad key is a one-line error now, not a traceback after
    # the engine's start.
    check_server_tls(cfg.serve)
    http_socket = listen(cfg.serve.host, cfg.serve.port, "serve.port")
    if cfg.serve.in_clear_beyond_loopback():
        print(f"torchtitan_rl serve: warning: serve.host {cfg.serve.host} is reachable beyond this machine over plain "
              "HTTP: serve.token and serve.api_key travel in clear; set serve.ssl_certfile and serve.ssl_keyfile "
              "(HTTPS), or keep it on a private network", flush=True)
    bind_gloo(cfg.serve.host)  # before vLLM builds its process groups: their listeners follow serve.host too
    workdir = Path(cfg.job.output_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    task = run_task(cfg)
    shape = run_shape(cfg, task)
    device = run_device(cfg.job.device)
    tokenizer_dir = tokenizer_folder(cfg, task, workdir)
    generator = Engine(
        cfg.generator, model_config=cfg.model, shape=shape, seed=cfg.job.seed, device=device.type,
        workdir=workdir, batch_invariant=cfg.batch_invariant_mode, tokenizer_dir=tokenizer_dir,
    )
    loop = EngineLoop(generator, sync_wait_s=cfg.serve.sync_timeout_s)
    try:
        sessions = SyncSessions(loop, device=device, secret=cfg.serve.token, timeout_s=cfg.serve.sync_timeout_s,
                                store_bytes=int(cfg.serve.sync_store_mb * (1 << 20)), lease_s=cfg.serve.session_lease_s)
        server = RolloutServer(cfg, loop=loop, sessions=sessions, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))
        scheme = "https" if cfg.serve.ssl_certfile else "http"
        print(f"torchtitan_rl serve: {scheme}://{cfg.serve.host}:{cfg.serve.port} (model {cfg.serve.model_name!r}, "
              f"generation {'behind serve.api_key' if cfg.serve.api_key else 'open'}); "
              "nothing is served before the trainer's first sync", flush=True)
        uvicorn.Server(uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=5,
                                      http=with_header_deadline(cfg.serve.read_timeout_s),
                                      ssl_certfile=cfg.serve.ssl_certfile or None,
                                      ssl_keyfile=cfg.serve.ssl_keyfile or None)).run(sockets=[http_socket])
    finally:
        loop.close()


if __name__ == "__main__":
    main()
