"""``flowrl serve-reward``: a reward over HTTP for the ``remote`` reward."""

from __future__ import annotations

import json

from ..cli_types import port, positive_number
from ..errors import FlowRLError


def cmd_serve_reward(args) -> int:
    from ..rewards.remote import serve

    try:
        reward_args = json.loads(args.args) if args.args else {}
    except json.JSONDecodeError as exc:
        raise FlowRLError(f"--args must be a JSON object such as '{{\"scale\": 26}}' ({exc.msg})") from exc
    if not isinstance(reward_args, dict):
        raise FlowRLError("--args must be a JSON object")
    serve(args.name, reward_args, args.host, args.port, max_body_mb=args.max_mb)
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands on the ``flowrl`` parser's ``sub``."""
    sr = sub.add_parser("serve-reward", help="serve a reward over HTTP (POST /score) for the `remote` reward")
    sr.add_argument("name", help="registered reward name or module:function")
    sr.add_argument("--args", help="the reward's keyword arguments as a JSON object")
    sr.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 serves other machines)")
    sr.add_argument("--port", type=port, default=8765, help="0 picks a free port (printed on the first line)")
    sr.add_argument("--max-mb", type=positive_number, default=64.0, help="largest request body accepted, in MiB")
    sr.set_defaults(func=cmd_serve_reward)

