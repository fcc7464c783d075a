"""What finetune.py and finetune_trainer.py share: the offline tiny model and tokenizer, the sample text, the
token file, the loss plot, the export check. Kept here so both examples train on the very same data and
the two training loops stay short enough to read side by side."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

EOS = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, data, size and checkpoint flags both examples take."""
    src = parser.add_argument_group("model and data")
    model = src.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", metavar="DIR", help="a local pretrained Hugging Face causal-LM directory "
                       "(config.json, safetensors, tokenizer files)")
    model.add_argument("--make-tiny", action="store_true", help="first write a small Llama and a byte-level BPE "
                       "tokenizer to OUT/tiny-model (no download) and fine-tune that")
    data = src.add_mutually_exclusive_group()
    data.add_argument("--text", nargs="+", metavar="FILE", help="text file(s), tokenized into OUT/tokens.npy")
    data.add_argument("--tokens", metavar="PATH", help="an existing token .npy (or a directory of .npy shards)")
    src.add_argument("--out", required=True, metavar="DIR", help="where everything is written")
    src.add_argument("--prompt", default=None, help="prompt of the generated sample (default: the text's first words)")
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=40, help="optimizer steps in all (a resumed run continues to it)")
    run.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    run.add_argument("--micro-batch", type=int, default=8, help="windows per micro-batch")
    run.add_argument("--seq-len", type=int, default=64, help="tokens per window (predicted tokens per row)")
    run.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3 with --make-tiny, "
                     "else 2e-5)")
    run.add_argument("--warmup", type=int, default=4, help="linear warmup steps before the cosine decay")
    run.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    run.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    run.add_argument("--resume", action="store_true", help="continue from the newest checkpoint under OUT")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="compute dtype (bfloat16 runs the forward under autocast)")
    mem = parser.add_argument_group("offload")
    mem.add_argument("--nvme-path", default=None, metavar="DIR", help="swap directory for the optimizer state "
                     "(default OUT/swap; put it on your fastest disk)")
    mem.add_argument("--moments", choices=("fp32", "bf16", "int8"), default="fp32",
                     help="how the Adam moments are kept (offload.wrap's moments=): fp32 (exact), bf16, int8")
    mem.add_argument("--host-memory", default=None, help='host memory budget, e.g. "64GB" (default: none)')
    mem.add_argument("--device-memory", default=None, help='device memory budget, e.g. "20GB" (default: none)')


def sample_text(path: str, lines: int = 4000, seed: int = 0) -> str:
    """A generated corpus with structure a tiny model learns within a few dozen steps: sentences from a small
    grammar and counting runs. About 150 KB; deterministic, so a resumed run reads the same tokens."""
    rng = random.Random(seed)
    subjects = ["the cat", "the dog", "a small bird", "my old friend", "the farmer", "a young child", "the teacher"]
    verbs = ["sees", "likes", "follows", "finds", "hears", "helps", "watches"]
    objects = ["the red ball", "a green apple", "the big house", "a quiet river", "the yellow car", "a tall tree"]
    places = ["in the garden", "near the river", "at home", "on the hill", "by the sea", "in the morning"]
    numbers = "zero one two three four five six seven eight nine ten eleven twelve".split()
    out = []
    for _ in range(lines):
        if rng.random() < 0.25:
            start = rng.randrange(0, len(numbers) - 5)
            out.append("counting: " + " ".join(numbers[start:start + rng.randint(3, 6)]) + ".")
        else:
            out.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(places)}.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    return path


def make_tiny(directory: str, texts: Sequence[str], seed: int = 0, vocab_size: int = 512) -> str:
    """A byte-level BPE tokenizer trained on `texts` and a small randomly initialized Llama, both saved with
    `save_pretrained` into `directory`: a pretrained-model directory like any other, made offline. Kept if
    it is already there (a resumed run must fine-tune the same start)."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prepare(args: argparse.Namespace) -> Tuple[str, str, List[str]]:
    """(model directory, token file, text files) from the flags: the tiny model when asked for, the sample
    text when no data is given with it, and the text tokenized with the model's own tokenizer."""
    from offload.cli.tokenize import tokenize_files

    os.makedirs(args.out, exist_ok=True)
    texts = list(args.text or [])
    if args.make_tiny and not texts and not args.tokens:
        texts = [os.path.join(args.out, "sample.txt")]
        if not os.path.isfile(texts[0]):
            sample_text(texts[0], seed=args.seed)
    model_dir = make_tiny(os.path.join(args.out, "tiny-model"), texts, args.seed) if args.make_tiny else args.model
    if args.tokens:
        return model_dir, args.tokens, texts
    if not texts:
        raise SystemExit("give --text FILE... or --tokens PATH (or --make-tiny for the built-in sample)")
    tokens = os.path.join(args.out, "tokens.npy")
    if not (args.resume and os.path.isfile(tokens)):  # a resumed stream must read the same file
        tokenize_files(model_dir, texts, tokens)
    return model_dir, tokens, texts


def peak_lr(args: argparse.Namespace) -> float:
    return args.lr if args.lr is not None else (3e-3 if args.make_tiny else 2e-5)


def default_prompt(args: argparse.Namespace, texts: Sequence[str]) -> str:
    if args.prompt:
        return args.prompt
    for path in texts:
        with open(path, encoding="utf-8", errors="replace") as f:
            words = f.readline().split()
        if words:
            return " ".join(words[:3])
    return "The"


def plot_losses(history: Sequence[Dict[str, float]], path: str, title: str) -> Optional[str]:
    """The loss curve as a PNG, or a note when matplotlib is missing (it is optional)."""
    from offload.cli.loss_curve import save_loss_curve

    saved = save_loss_curve([h["loss"] for h in history], path, title, steps=[int(h["step"]) for h in history])
    print(f"loss curve: {path}" if saved else f"(matplotlib is not installed: no {path}; pip install matplotlib)")
    return saved


def print_stats(stats: Dict[str, float]) -> None:
    """engine.stats() as a two-column table, the counters that are not zero."""
    rows = [(k, v) for k, v in stats.items() if v]
    width = max((len(k) for k, _ in rows), default=0)
    print("engine.stats():")
    for key, value in rows:
        text = f"{value:,.3f}" if isinstance(value, float) and not float(value).is_integer() else f"{int(value):,}"
        print(f"  {key:<{width}}  {text:>16}")


def copy_tokenizer(model_dir: str, final: str) -> None:
    """The tokenizer files beside the exported weights, so the directory is a complete model."""
    for name in TOKENIZER_FILES + ("vocab.json", "merges.txt", "tokenizer.model", "generation_config.json"):
        source = os.path.join(model_dir, name)
        if os.path.isfile(source) and not os.path.exists(os.path.join(final, name)):
            shutil.copy2(source, final)


def generate_sample(final: str, prompt: str, new_tokens: int = 20) -> str:
    """Load the export with plain transformers (no offload) and continue `prompt` greedily: proof that the
    directory is a working Hugging Face model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    print(f"sample from {final} (plain transformers, greedy): {text!r}")
    return text


def show_export(args: argparse.Namespace, model_dir: str, final: str, texts: Sequence[str]) -> None:
    """Put the tokenizer beside the exported weights, then show the export works: a greedy sample from it
    loaded with plain transformers."""
    copy_tokenizer(model_dir, final)
    print(f"exported: {final}")
    generate_sample(final, default_prompt(args, texts))


def write_json(path: str, value: object) -> None:
    """Written to a temporary name and renamed: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)
