"""``fairseq-train`` whose ``--bf16`` trains on CUDA (used by train.sh for PRECISION=bf16).

fairseq 0.12's argument post-processing (``fairseq.options.parse_args_and_arch``) turns
``--bf16`` into ``--tpu`` as well, so ``fairseq-train --bf16`` on a GPU machine asks for
torch_xla and fails. Its trainer itself supports bf16 on CUDA (model and batches cast to
bfloat16, fp32 master weights in ``FP16Optimizer``, no loss scaling). This entry point runs
the stock ``fairseq_cli.train`` and only undoes the implied ``--tpu`` when ``--tpu`` was not
on the command line. Everything else, including distributed launching, is fairseq's own.
"""
import sys

from fairseq import options

_parse_args_and_arch = options.parse_args_and_arch


def _parse_keeping_cuda(*args, **kwargs):
    parsed = _parse_args_and_arch(*args, **kwargs)
    if getattr(parsed, "bf16", False) and "--tpu" not in sys.argv[1:]:
        parsed.tpu = False
    return parsed


def main() -> None:
    options.parse_args_and_arch = _parse_keeping_cuda
    from fairseq_cli.train import cli_main

    cli_main()


if __name__ == "__main__":
    main()
