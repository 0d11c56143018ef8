"""Flags that several bench CLIs share."""

from __future__ import annotations

import argparse


def add_server_source(parser: argparse.ArgumentParser, url_help: str, launch_help: str,
                      required: bool = True) -> argparse._MutuallyExclusiveGroup:
    """--url (a running server) or --launch (servers this run starts, with --model); the group, for
    a CLI that offers a third source."""
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--url", help=url_help)
    src.add_argument("--launch", action="store_true", help=launch_help)
    parser.add_argument("--model", default="models/tiny", help="the model of --launch servers")
    return src
