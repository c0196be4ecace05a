"""`python app.py`: the StableTune UI in a browser.

Listens on 127.0.0.1:7870 (A1111 keeps 7860) unless --listen / --port. A --share link or a --listen
server is reachable by others, so it always has a login: --auth user:pass, or a random password printed
here. The browser may read only the runs folder (samples,
LoRA downloads) and the folders given with --allow-dir; dataset images are shown as thumbnails.
"""
from __future__ import annotations

import argparse
import errno
import secrets
import socket
import sys
from pathlib import Path

SHARE_USER = "stabletune"
DEFAULT_PORT = 7870  # not 7860: AUTOMATIC1111 and Forge serve there, often on the same machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port to serve on (default {DEFAULT_PORT}).")
    parser.add_argument("--listen", action="store_true", help="Serve on all interfaces (0.0.0.0), not only "
                        "this machine (needs a login: --auth, or a random password is printed).")
    parser.add_argument("--share", action="store_true", help="Create a public gradio.live link (needs a login: "
                        "--auth, or a random password is printed).")
    parser.add_argument("--auth", metavar="USER:PASS", help="Require this login.")
    parser.add_argument("--runs-dir", default="runs", help="Folder of the run directories (default ./runs).")
    parser.add_argument("--engine-python", default=sys.executable, help="Python that trains (has torch); "
                        "default: this one.")
    parser.add_argument("--model-dir", action="append", default=[], help="Folder to search for base models "
                        "(repeatable).")
    parser.add_argument("--allow-dir", action="append", default=[], help="Another folder the browser may read "
                        "files from (repeatable).")
    parser.add_argument("--num-processes", type=int, default=1, help="Devices to train on (accelerate).")
    parser.add_argument("--refresh-seconds", type=float, default=2.0, help="Seconds between live updates.")
    return parser.parse_args(argv)


def login(args: argparse.Namespace) -> tuple[str, str] | None:
    """The (user, password) to require, or None. A share link or a --listen server without --auth gets a
    random password: both are reachable by other people."""
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise SystemExit("--auth must look like user:password")
        return user, password
    if args.share or args.listen:
        return SHARE_USER, secrets.token_urlsafe(12)
    return None


def launch_options(args: argparse.Namespace) -> dict:
    runs_dir = Path(args.runs_dir).expanduser().resolve()
    return {
        "server_name": "0.0.0.0" if args.listen else "127.0.0.1",
        "server_port": args.port,
        "share": args.share,
        "auth": login(args),
        "allowed_paths": [str(runs_dir), *(str(Path(d).expanduser().resolve()) for d in args.allow_dir)],
    }


def port_problem(host: str, port: int) -> str | None:
    """One sentence when `port` cannot be served on `host` (checked before the UI is built)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is in use (another StableTune, or a WebUI?); pass --port N with a free port."
            return f"cannot serve on {host}:{port} ({exc.strerror}); pass --port N or check --listen."
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = launch_options(args)
    problem = port_problem(options["server_name"], options["server_port"])
    if problem:
        raise SystemExit(f"StableTune: {problem}")
    if options["auth"] and not args.auth:
        where = "Share link" if args.share else f"Server on 0.0.0.0:{args.port}"
        print(f"{where} login: user '{options['auth'][0]}', password '{options['auth'][1]}'", flush=True)

    from extension import compat
    from extension.settings import UISettings
    from extension.ui import STYLE, build_ui

    settings = UISettings(runs_dir=Path(args.runs_dir), engine_python=args.engine_python,
                          model_dirs=[Path(d) for d in args.model_dir], num_processes=args.num_processes,
                          refresh_seconds=args.refresh_seconds)
    blocks = build_ui(settings)
    blocks.queue()  # live updates need the queue on Gradio 3.x; later versions have it on already
    # Gradio 6 takes the page's CSS at launch (older ones got it in gr.Blocks, and ignore it here).
    compat.make(blocks.launch, css=STYLE, **options)


if __name__ == "__main__":
    main()
