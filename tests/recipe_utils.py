"""Shared by the recipe tests (tests/test_recipes*.py): the environment and runner of the
scripts in examples/, tiny archives in the formats of the real downloads (WMT: tgz of
plain-text corpora, a tar of gzipped giga-fren files, tgz of SGML dev/test sets; IWSLT: one
tgz of train.tags files and XML dev/test sets), and computations written independently of
the code under test (n-gram BLEU, the clean-corpus rules)."""
from __future__ import annotations

import collections
import gzip
import http.server
import io
import math
import os
import random
import re
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.join(REPO, ".venv", "bin")
RECIPES_PY = os.path.join(REPO, "examples", "common", "recipes.py")
EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, os.path.join(REPO, "examples", "common"))

import recipes  # noqa: E402,F401  (pure python: no torch / fairseq)


# ======================================================================================
# fixture archives in the formats of the real downloads
# ======================================================================================

WORDS = {
    "en": "house dog cat garden city river car book child mother water tree school friend "
          "road small big old new green red fast runs sleeps reads sees likes builds".split(),
    "de": "Haus Hund Katze Garten Stadt Fluss Auto Buch Kind Mutter Wasser Baum Schule Freund "
          "Straße klein groß alt neu grün rot schnell läuft schläft liest sieht mag baut".split(),
    "fr": "maison chien chat jardin ville rivière voiture livre enfant mère eau arbre école ami "
          "route petit grand vieux nouveau vert rouge vite court dort lit voit aime construit".split(),
}
HYPHENATED = {"en": "state-of-the-art", "de": "hoch-modern", "fr": "dernier-cri"}


def make_corpus(rng, src, tgt, n):
    """n aligned sentence pairs of a toy language pair (word-by-word 'translation'), with
    hyphenated compounds, '&', quotes and the right single quote the Moses steps act on."""
    pairs = []
    for _ in range(n):
        idx = [rng.randrange(len(WORDS["en"])) for _ in range(rng.randint(3, 9))]
        s = [WORDS[src][i] for i in idx]
        t = [WORDS[tgt][i] for i in idx]
        roll = rng.random()
        if roll < 0.2:
            s.insert(1, HYPHENATED[src]); t.insert(1, HYPHENATED[tgt])
        elif roll < 0.3:
            s.insert(2, "&"); t.insert(2, "&")
        elif roll < 0.4:
            s[0] = '"' + s[0] + '"'; t[0] = '"' + t[0] + '"'
        elif roll < 0.5:
            s[-1] += "\u2019s"; t[-1] += "\u2019s"
        pairs.append((" ".join(s).capitalize() + ".", " ".join(t).capitalize() + "."))
    return pairs


def special_pairs():
    """Pairs the cleaning must drop: empty, too long, too unbalanced."""
    return [("", ""), (" ".join(["house"] * 300), " ".join(["Haus"] * 300)),
            ("dog", " ".join(["Hund"] * 9))]


def _add_file(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path, files, gz=True):
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, text in files.items():
            _add_file(tar, name, text if isinstance(text, bytes) else text.encode("utf-8"))


def lines(texts):
    return "".join(t + "\n" for t in texts)


def sgm(lines_, setid, lang, kind):
    """WMT SGML (srcset/refset, doc, p, seg) as in newstest20xx-*.sgm."""
    tag = "srcset" if kind == "src" else "refset"
    body = "".join(f'<seg id="{i}">{t}</seg>\n' for i, t in enumerate(lines_, 1))
    return (f'<{tag} setid="{setid}" srclang="any" trglang="{lang}">\n'
            f'<doc sysid="{kind}" docid="1-test" genre="news" origlang="en">\n'
            f"<p>\n{body}</p>\n</doc>\n</{tag}>\n")


def iwslt_xml(lines_, setid, lang):
    body = "".join(f'<seg id="{i}"> {t} </seg>\n' for i, t in enumerate(lines_, 1))
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n'
            f'<srcset setid="{setid}" srclang="{lang}">\n<doc docid="1" genre="lectures">\n'
            f"<url>http://www.ted.com/talks/x.html</url>\n<talkid>1</talkid>\n"
            f"<title>A talk</title>\n{body}</doc>\n</srcset>\n</mteval>\n")


def build_wmt_site(root, src, tgt, rng, n_train=(60, 40, 40), n_dev=10, n_test=12):
    """The WMT14 archives under root/wmt1x/ for src-tgt (en-de or en-fr). Returns what the
    test checks against: the train pairs as written, and the raw test references."""
    pair = f"{tgt}-{src}"  # WMT names the pair de-en / fr-en
    names = {
        "de": [("wmt13/training-parallel-europarl-v7.tgz", f"training/europarl-v7.{pair}"),
               ("wmt13/training-parallel-commoncrawl.tgz", f"commoncrawl.{pair}"),
               ("wmt14/training-parallel-nc-v9.tgz", f"training/news-commentary-v9.{pair}")],
        "fr": [("wmt13/training-parallel-europarl-v7.tgz", f"training/europarl-v7.{pair}"),
               ("wmt13/training-parallel-commoncrawl.tgz", f"commoncrawl.{pair}"),
               ("wmt13/training-parallel-un.tgz", f"un/undoc.2000.{pair}"),
               ("wmt14/training-parallel-nc-v9.tgz", f"training/news-commentary-v9.{pair}"),
               ("wmt10/training-giga-fren.tar", "giga-fren.release2.fixed")],
    }[tgt]
    all_pairs = []
    for k, (archive, prefix) in enumerate(names):
        pairs = make_corpus(rng, src, tgt, n_train[k % len(n_train)])
        if k == 0:
            pairs = special_pairs() + pairs
            # a carriage return and a bell inside a sentence must not break the alignment
            pairs.append(("The dog\r runs\x07 fast.", "Der Hund\r läuft\x07 schnell."))
        all_pairs += pairs
        path = os.path.join(root, archive)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        files = {f"{prefix}.{src}": lines(p[0] for p in pairs),
                 f"{prefix}.{tgt}": lines(p[1] for p in pairs)}
        if archive.endswith(".tar"):
            files = {name + ".gz": gzip.compress(text.encode("utf-8")) for name, text in files.items()}
            write_tar(path, files, gz=False)
        else:
            files[f"{prefix.rsplit('/', 1)[0]}/README" if "/" in prefix else "README"] = "corpus\n"
            write_tar(path, files)
    dev = make_corpus(rng, src, tgt, n_dev)
    write_tar(os.path.join(root, "wmt14/dev.tgz"), {
        f"dev/newstest2013-src.{src}.sgm": sgm([d[0] for d in dev], "newstest2013", src, "src"),
        f"dev/newstest2013-ref.{tgt}.sgm": sgm([d[1] for d in dev], "newstest2013", tgt, "ref"),
        f"dev/newstest2013.{src}": lines(d[0] for d in dev),
        f"dev/newstest2013.{tgt}": lines(d[1] for d in dev),
    })
    test = make_corpus(rng, src, tgt, n_test)
    code = f"{tgt}{src}" if tgt == "de" else f"{tgt}{src}"
    write_tar(os.path.join(root, "wmt14/test-full.tgz"), {
        f"test-full/newstest2014-{code}-src.{src}.sgm": sgm([t[0] for t in test], "newstest2014", src, "src"),
        f"test-full/newstest2014-{code}-ref.{tgt}.sgm": sgm([t[1] for t in test], "newstest2014", tgt, "ref"),
    })
    return all_pairs, test


IWSLT_TEST_SETS = ["IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                   "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012"]


def build_iwslt_site(root, rng, n_train=230, n_test=3):
    """de-en.tgz as fairseq's IWSLT14 download: de-en/train.tags.de-en.{de,en} with talk
    metadata lines, and the XML dev/test sets."""
    pairs = special_pairs() + make_corpus(rng, "de", "en", n_train)
    meta = [("<url>http://www.ted.com/talks/a.html</url>",) * 2,
            ("<keywords>talks, science</keywords>",) * 2,
            ("<talkid>1</talkid>",) * 2,
            ("<title>Ein Vortrag</title>", "<title>A talk</title>"),
            ("<description>TED Talk: Baum</description>", "<description>TED Talk: tree</description>")]
    tagged = meta + pairs
    files = {"de-en/train.tags.de-en.de": lines(p[0] for p in tagged),
             "de-en/train.tags.de-en.en": lines(p[1] for p in tagged)}
    test = []
    for name in IWSLT_TEST_SETS:
        part = make_corpus(rng, "de", "en", n_test)
        test += part
        files[f"de-en/{name}.de-en.de.xml"] = iwslt_xml([p[0] for p in part], name, "de")
        files[f"de-en/{name}.de-en.en.xml"] = iwslt_xml([p[1] for p in part], name, "en")
    os.makedirs(os.path.join(root, "iwslt"), exist_ok=True)
    write_tar(os.path.join(root, "iwslt", "de-en.tgz"), files)
    return tagged, test


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def script_env(**extra):
    env = dict(os.environ)
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NNODES",
                "NUM_GPUS", "NNODES", "LAUNCHER", "EXTRA_ARGS", "DATA_DIR", "RUN_DIR",
                "ADMIN_INIT", "OPTIMIZER", "PRECISION", "DEVICE", "MAX_TOKENS",
                "EFFECTIVE_BATCH", "KEEP_LAST_EPOCHS", "AVG_LAST", "CHECKPOINT_UPPER_BOUND",
                "CHECKPOINT", "BEAM", "LENPEN", "GEN_EXTRA_ARGS", "FAIRSEQ_BIN", "PYTHON"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(args, env, cwd, check=True, timeout=300):
    result = subprocess.run(["bash"] + [str(a) for a in args], env=env, cwd=str(cwd),
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{args} failed ({result.returncode})\nstdout:\n{result.stdout[-4000:]}\n"
            f"stderr:\n{result.stderr[-4000:]}")
    return result


def ref_bleu(hyps, refs):
    """Corpus BLEU-4 (Papineni et al. 2002) on whitespace tokens, no smoothing: an
    independent statement of multi-bleu.perl."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for h, r in zip(hyps, refs):
        h, r = h.split(), r.split()
        hyp_len += len(h)
        ref_len += len(r)
        for n in range(1, 5):
            hc = collections.Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rc = collections.Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * bp * math.exp(log_p)


def ref_compound_split(line):
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def write_generate_output(path, hyps):
    """fairseq-generate's format: S/T/H/D/P lines, ids in arbitrary order."""
    order = list(range(len(hyps)))
    random.Random(5).shuffle(order)
    with open(path, "w", encoding="utf-8") as out:
        for i in order:
            out.write(f"S-{i}\tsrc\nT-{i}\tref\nH-{i}\t-0.5\t{hyps[i]}\nD-{i}\t-0.5\t{hyps[i]}\nP-{i}\t-0.1\n")
        out.write("Generate test with beam=4: BLEU4 = 1.00\n")


def clean_reference(src, tgt, lo, hi, ratio):
    """Independent statement of clean-corpus-n.perl's filter."""
    s, t = src.split(), tgt.split()
    if not s or not t or not (lo <= len(s) <= hi) or not (lo <= len(t) <= hi):
        return False
    return max(len(s) / len(t), len(t) / len(s)) <= ratio


def command_lines(stdout):
    return [l for l in stdout.splitlines() if l.startswith("+ ")]


def command_args(stdout):
    line = [l for l in stdout.splitlines() if l.startswith("+ ")][-1]
    return line
