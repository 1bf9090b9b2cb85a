"""Build admin_transformer / transformer models in-process the way fairseq-train does."""
from __future__ import annotations

from typing import Sequence

import torch
from fairseq import options, tasks

from fairseq_cli_utils import USER_DIR


def parse(data, arch: str, extra: Sequence[str] = ()):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, [str(data), "--user-dir", USER_DIR, "--arch", arch, "--cpu", *map(str, extra)]
    )


def build(data, arch: str, extra: Sequence[str] = (), seed: int = 1):
    args = parse(data, arch, extra)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    return model, task, args
