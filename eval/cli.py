"""``metachunk eval qa | chunk-quality | diagnostics | compare``.

Each command lives in its own module, which owns its config dataclass and its ``run(cfg)``; this
file only lists them. ``metachunk/cli.py`` calls :func:`add_parser` and dispatches through the
``handler`` each command sets. Importing this module must stay cheap (no torch): the command
modules import their heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse

# (action, module, config class name, help): each module defines CONFIG and run(cfg) -> int.
COMMANDS = [
    (
        "qa",
        "metachunk.eval.qa",
        "retrieve with an embedded Milvus index, answer, score (BLEU, ROUGE-L, BERTScore, F1)",
    ),
    (
        "chunk-quality",
        "metachunk.eval.chunk_quality",
        "Boundary Clarity and Chunk Stickiness (MoC §3.1), no QA needed",
    ),
    (
        "diagnostics",
        "metachunk.eval.diagnostics",
        "semantic-completion diagnostics: PPL of rewrites, AVGSim@k, CP",
    ),
    ("compare", "metachunk.eval.compare", "side-by-side table + PNG bar chart per metric over eval run dirs"),
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    import importlib

    from metachunk import config

    parser = sub.add_parser(
        "eval", help="measure chunkers and RAG answers (metrics.json + report.md per run)"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    for action, module_name, about in COMMANDS:
        module = importlib.import_module(module_name)
        command = actions.add_parser(action, help=about, description=about)
        config.add_arguments(command, module.CONFIG)
        command.set_defaults(handler=_handler(module))


def _handler(module):
    def handle(args: argparse.Namespace) -> int:
        from metachunk import config

        return module.run(config.from_namespace(module.CONFIG, args))

    return handle
