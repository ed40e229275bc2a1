"""The engine server's shadow-drafting flags (shadow.py), kept torch-free: building the command
line's parser imports no model code."""

from __future__ import annotations

import argparse

DEFAULT_SHARE = 0.1    # shadow.DEFAULT_SHARE (not imported here: shadow.py imports torch)


def share(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return number


def add_shadow_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "shadow drafting (a candidate release's drafter scored on live requests; it never "
        "changes a reply; docs/shadow.md)")
    group.add_argument("--shadow-release", metavar="FILE",
                       help="the candidate release file; its target must be the one served")
    group.add_argument("--shadow-share", type=share, default=DEFAULT_SHARE, metavar="SHARE",
                       help="share of requests the candidate is scored on, 0..1")


def attach_shadow_from_args(engine, args, progress=print):
    """The engine with the candidate of --shadow-release attached (unchanged without it)."""
    if not getattr(args, "shadow_release", None):
        return engine
    from specpair.shadow import attach_shadow

    scorer = attach_shadow(engine, args.shadow_release, share=args.shadow_share,
                           serving_target=(args.target, getattr(args, "target_revision", None)))
    progress(f"shadow: candidate v{scorer.candidate.version} ({scorer.candidate.content_hash[:12]}, "
             f"{scorer.drafter.name}) scored on {args.shadow_share:g} of requests")
    return engine
