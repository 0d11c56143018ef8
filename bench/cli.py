"""Flags that several bench CLIs share."""

from __future__ import annotations

import argparse

from branchwise.taper.policies import parse_policy_name


def add_server_source(parser: argparse.ArgumentParser, url_help: str, launch_help: str,
                      required: bool = True) -> argparse._MutuallyExclusiveGroup:
    """--url (a running server) or --launch (servers this run starts, with --model); the group, for
    a CLI that offers a third source."""
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--url", help=url_help)
    src.add_argument("--launch", action="store_true", help=launch_help)
    parser.add_argument("--model", default="models/tiny", help="the model of --launch servers")
    return src


def policy_list(text: str) -> tuple[str, ...]:
    """--policies as argparse's type: comma-separated names, each canonical (parse_policy_name), so a
    bad or retired name fails at argument parsing with the policy parser's message, before any
    server starts."""
    try:
        names = tuple(parse_policy_name(name) for name in text.split(",") if name.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not names:
        raise argparse.ArgumentTypeError("need at least one policy")
    return names
