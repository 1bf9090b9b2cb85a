"""Pure-python helpers behind the recipes in ``examples/<task>/`` (prepare, train, eval).

It lives next to the scripts that use it (``examples/common/lib.sh`` calls it as
``python examples/common/recipes.py CMD``), keeps its helpers in ``recipekit/`` beside it
and imports neither torch, fairseq nor the plugin, so each call costs a fraction of a second; the text tools (sacremoses, sacrebleu,
regex) are imported only by the sub-commands that need them.

Sub-commands (``--help`` on each):

* ``gpus``          number of visible GPUs (``CUDA_VISIBLE_DEVICES``, ``nvidia-smi -L``);
* ``update-freq``   ``--update-freq`` such that GPUs x max-tokens x update-freq equals the
                    recipe's effective batch, or a refusal naming valid alternatives;
* ``run-config``    record a run's defining settings on first start, refuse a resume whose
                    settings differ (a run folder is resumed, never reused for another run);
* ``fetch``         download an archive (``.part`` then rename) and check it (gzip / tar
                    integrity read to the end, sha256 when known); no network -> a message;
* ``extract``       unpack a checked archive and check that the expected members exist;
* ``tokenize``      Moses tokenisation with sacremoses (punctuation normalisation, removal of
                    non-printing characters, aggressive hyphen splitting ``-a``, lowercasing),
                    from plain text, WMT/IWSLT SGML ``<seg>`` files or IWSLT ``train.tags``;
* ``clean``         length / ratio filter of a parallel corpus (clean-corpus-n.perl rules);
* ``score``         from ``fairseq-generate`` output: tokenized BLEU (the Admin paper's
                    scoring), detokenized sacreBLEU with its signature, and for En-De the
                    compound-split BLEU (tensor2tensor's convention), each labelled;
* ``split-args``    split a string such as ``EXTRA_ARGS`` into words as the shell does
                    (quotes, backslashes; no expansion) and print them shell-quoted.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Optional, Sequence

# the helpers live in recipekit/ beside this script (on sys.path when run as a script)
from recipekit import RecipeError, atomic_write_text
from recipekit.batching import (count_visible_gpus, plan_update_freq, suggest_gpu_counts,
                                suggest_max_tokens, _nvidia_smi_listing)
from recipekit.downloads import extract, fetch, read_checksums
from recipekit.rundir import check_run_config
from recipekit.scoring import compound_split, read_generate_hypotheses, score_generation
from recipekit.text import MosesPipeline, clean_corpus, tokenize_files

#: what ``import recipes`` offers besides the command line (the tests use these)
__all__ = ["RecipeError", "clean_corpus", "compound_split", "count_visible_gpus", "fetch",
           "main", "MosesPipeline", "plan_update_freq", "read_checksums",
           "read_generate_hypotheses", "score_generation", "shell_quoted_words",
           "suggest_gpu_counts", "suggest_max_tokens", "tokenize_files"]


def shell_quoted_words(text: str, name: str = "value") -> str:
    """``text`` split into words by the shell's rules (:func:`shlex.split`: quotes and
    backslashes; no variable, command or glob expansion), printed shell-quoted and
    space-separated: what ``eval "array=($output)"`` turns back into exactly those words."""
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise RecipeError(f"{name} cannot be split into arguments ({error}): {text!r}") from None
    return " ".join(shlex.quote(w) for w in words)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _cmd_gpus(args) -> None:
    print(count_visible_gpus(os.environ, _nvidia_smi_listing()))


def _cmd_update_freq(args) -> None:
    print(plan_update_freq(args.effective_batch, args.num_gpus, args.max_tokens).update_freq)


def _cmd_run_config(args) -> None:
    settings = {}
    for item in args.settings:
        if "=" not in item:
            raise RecipeError(f"run-config: setting {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        settings[key] = value
    print(check_run_config(args.run_dir, settings))


def _cmd_fetch(args) -> None:
    sums = read_checksums(args.checksums)
    expected = args.sha256 or sums.get(os.path.basename(args.dest))
    fetch(args.url, args.dest, expected, timeout=args.timeout)


def _cmd_extract(args) -> None:
    extract(args.archive, args.dest, args.expect)
    print(f"extract: {args.archive} -> {args.dest}")


def _cmd_tokenize(args) -> None:
    pipeline = MosesPipeline(args.lang, args.aggressive, args.normalize_punct,
                             args.remove_non_printing, args.rsquo, args.lowercase)
    for path in args.inputs:
        if not os.path.exists(path):
            raise RecipeError(f"tokenize: input {path} does not exist")
    count = tokenize_files(args.inputs, args.output, pipeline, args.input_format,
                           args.raw_output, args.workers)
    print(f"tokenize: {count} lines -> {args.output}")


def _cmd_clean(args) -> None:
    read, kept = clean_corpus(
        f"{args.prefix}.{args.src}", f"{args.prefix}.{args.tgt}",
        f"{args.out_prefix}.{args.src}", f"{args.out_prefix}.{args.tgt}",
        args.min, args.max, args.ratio, args.lowercase,
    )
    print(f"clean: {args.prefix}: kept {kept} of {read} pairs "
          f"({args.min}..{args.max} tokens, ratio <= {args.ratio})")


def _cmd_score(args) -> None:
    result = score_generation(args.generate_output, args.tok_ref, args.raw_ref, args.lang,
                              args.compound_split, args.lowercase)
    hyps = result.pop("detokenized_hypotheses")
    if args.detok_output:
        with open(args.detok_output, "w", encoding="utf-8") as handle:
            handle.writelines(h + "\n" for h in hyps)
    print(f"tokenized BLEU (the Admin paper's scoring: fairseq-generate's BLEU4 on the "
          f"Moses-tokenized reference): {result['tokenized']:.2f}")
    print(f"detokenized sacreBLEU: {result['sacrebleu']:.2f}  "
          f"signature: {result['sacrebleu_signature']}")
    if args.compound_split:
        print(f"tokenized BLEU, compound split (a-b -> a ##AT##-##AT## b, tensor2tensor's "
              f"get_ende_bleu.sh convention; not the Admin paper's scoring): "
              f"{result['compound_split']:.2f}")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2, sort_keys=True) + "\n")


def _cmd_split_args(args) -> None:
    print(shell_quoted_words(args.value, args.name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recipes.py", description="helpers for the recipes in examples/<task>/"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("gpus", help="number of visible GPUs")
    p.set_defaults(func=_cmd_gpus)

    p = sub.add_parser("update-freq", help="--update-freq reaching the effective batch")
    p.add_argument("--effective-batch", required=True, help="tokens per optimizer update")
    p.add_argument("--num-gpus", required=True, help="data-parallel processes, all nodes")
    p.add_argument("--max-tokens", required=True, help="fairseq --max-tokens per GPU")
    p.set_defaults(func=_cmd_update_freq)

    p = sub.add_parser("run-config", help="record / check a run folder's settings")
    p.add_argument("--run-dir", required=True)
    p.add_argument("settings", nargs="*", help="KEY=VALUE")
    p.set_defaults(func=_cmd_run_config)

    p = sub.add_parser("fetch", help="download and check an archive")
    p.add_argument("--url", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--sha256", help="expected sha256 (else looked up in --checksums)")
    p.add_argument("--checksums", help="sha256sum-format file of known digests")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without data")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("extract", help="unpack a checked archive")
    p.add_argument("--archive", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--expect", nargs="*", default=[], help="paths that must exist afterwards")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser("tokenize", help="Moses tokenisation (sacremoses)")
    p.add_argument("--lang", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--input-format", choices=("plain", "sgm", "iwslt-tags"), default="plain")
    p.add_argument("--raw-output", help="also write the extracted, untokenized text here")
    p.add_argument("--aggressive", action="store_true", help="tokenizer.perl -a")
    p.add_argument("--normalize-punct", action="store_true")
    p.add_argument("--remove-non-printing", action="store_true")
    p.add_argument("--rsquo", action="store_true", help="U+2019 -> ' before tokenizing")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("inputs", nargs="+")
    p.set_defaults(func=_cmd_tokenize)

    p = sub.add_parser("clean", help="length/ratio filter (clean-corpus-n.perl rules)")
    p.add_argument("prefix")
    p.add_argument("src")
    p.add_argument("tgt")
    p.add_argument("out_prefix")
    p.add_argument("min", type=int)
    p.add_argument("max", type=int)
    p.add_argument("--ratio", type=float, default=1.5)
    p.add_argument("--lowercase", action="store_true")
    p.set_defaults(func=_cmd_clean)

    p = sub.add_parser("score", help="tokenized + detokenized BLEU of fairseq-generate output")
    p.add_argument("--generate-output", required=True)
    p.add_argument("--tok-ref", required=True, help="Moses-tokenized reference")
    p.add_argument("--raw-ref", required=True, help="untokenized reference")
    p.add_argument("--lang", required=True, help="target language (detokenizer)")
    p.add_argument("--compound-split", action="store_true",
                   help="also print the compound-split BLEU (WMT En-De convention)")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive sacreBLEU")
    p.add_argument("--detok-output", help="write the detokenized hypotheses here")
    p.add_argument("--json", help="write the scores here")
    p.set_defaults(func=_cmd_score)

    p = sub.add_parser("split-args", help="split a string into shell words, print them quoted")
    p.add_argument("--name", default="value", help="what the string is (for error messages)")
    p.add_argument("value", help="the string, e.g. the value of EXTRA_ARGS (put -- before it)")
    p.set_defaults(func=_cmd_split_args)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
