"""`mseq generate --path CKPT [PROMPT ...]`: complete prompts with a trained checkpoint.

Prompts come from the arguments, from `--input-file` (one prompt per line, or `.jsonl` with a
"prompt" field per line), or, with neither, from an interactive prompt when stdin is a
terminal (the completion is printed token by token as it is produced). Output is the text,
or one JSON object per completion (`--output-format jsonl`: metaseq's result dict plus
"prompt" and "finish_reason").

Runs in one process on the CPU (or the current device) with the checkpoint's full weights,
gathered from ZeRO and tensor-parallel shards if it was saved by several ranks. Under a
launcher the model is sharded across the ranks (tensor parallelism) and rank 0 prints:

    deepspeed --num_gpus 2 --module metaseq_ds.cli.generate --path CKPT "a prompt"
"""

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import typer

from metaseq_ds.cli.guard import guarded, run_alone
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import COMPILE_HELP, GenerationOptions, StopItem
from metaseq_ds.streamed_text import StreamedText

OUTPUT_FORMATS = ("text", "jsonl")


def _flag(field: str) -> str:
    """`mseq generate`'s flag for a GenerationOptions field."""
    return "--" + field.replace("_", "-")


def _sampling_flag(field: str):
    """A `mseq generate` flag whose default and help (description, range) are the options' field's."""
    return typer.Option(GenerationOptions.model_fields[field].default, _flag(field),
                        help=GenerationOptions.describe(field, _flag))


def command(
    prompts: Optional[List[str]] = typer.Argument(None, help="prompts (none: --input-file, or an interactive prompt on a terminal)"),
    path: str = typer.Option(..., "--path", help="checkpoint: a save dir (its last checkpoint) or a checkpoint_* dir"),
    input_file: Optional[str] = typer.Option(None, "--input-file", help="prompts, one per line, or .jsonl with a \"prompt\" field"),
    max_tokens: int = _sampling_flag("max_tokens"),
    min_tokens: int = _sampling_flag("min_tokens"),
    temperature: float = _sampling_flag("temperature"),
    top_p: float = _sampling_flag("top_p"),
    top_k: int = _sampling_flag("top_k"),
    n: int = _sampling_flag("n"),
    best_of: Optional[int] = _sampling_flag("best_of"),
    logprobs: int = _sampling_flag("logprobs"),
    echo: bool = _sampling_flag("echo"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help=GenerationOptions.describe("stop", _flag) + "; repeatable"),
    seed: Optional[int] = _sampling_flag("seed"),
    length_penalty: float = _sampling_flag("length_penalty"),
    output_format: str = typer.Option("text", "--output-format", help="text, or jsonl (metaseq's result dicts)"),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help=COMPILE_HELP),
) -> None:
    """Complete prompts with a checkpoint: greedy, sampling (top-k/top-p) or beam search."""
    values = dict(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                  n=n, best_of=best_of, logprobs=logprobs, echo=echo, stop=stop or (), seed=seed,
                  length_penalty=length_penalty)
    with guarded("generate"):
        options = GenerationOptions.from_values(values, name=_flag)
        main(prompts or [], path, input_file, options, output_format, compile)


def main(prompts: List[str], path: str, input_file: Optional[str], options: GenerationOptions,
         output_format: str, compile: Optional[bool] = None) -> None:
    if output_format not in OUTPUT_FORMATS:
        raise UsageError(f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")
    if prompts and input_file:
        raise UsageError("give prompts as arguments or --input-file, not both")
    if input_file:
        prompts = read_prompts(Path(input_file))
    interactive = not prompts
    if interactive and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("under a launcher, give the prompts as arguments or with --input-file (no interactive prompt)")
    if interactive and not sys.stdin.isatty():
        raise UsageError("no prompts: give them as arguments, with --input-file, or run on a terminal for an interactive prompt")

    # stdout is the output (jsonl may be piped on): logs go to stderr, and so does whatever the
    # libraries print while the model loads (DeepSpeed logs its accelerator to stdout).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s | %(name)s | %(message)s",
                        force=True)
    with contextlib.redirect_stdout(sys.stderr):
        from metaseq_ds.hub_utils import GeneratorInterface

        interface = GeneratorInterface(path, compile=compile)
        interface.load_model()
    if interactive:
        run_interactive(interface, options, output_format)
        return
    results = interface.generate(prompts, options=options)
    if int(os.environ.get("RANK", "0")) != 0:  # every rank decodes the same tokens; one prints
        return
    for prompt, completions in zip(prompts, results):
        for completion in completions:
            print_result(prompt, completion, output_format)


def read_prompts(path: Path) -> List[str]:
    """One prompt per line (blank lines skipped), or jsonl objects with a "prompt" string."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UsageError(f"--input-file: cannot read {path} ({error.strerror})") from None
    if path.suffix != ".jsonl":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise UsageError(f"--input-file: {path}:{number} is not JSON ({error})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise UsageError(f'--input-file: {path}:{number} has no "prompt" string')
            prompts.append(record["prompt"])
    if not prompts:
        raise UsageError(f"--input-file: {path} holds no prompts")
    return prompts


def print_result(prompt: str, completion: dict, output_format: str) -> None:
    if output_format == "jsonl":
        print(json.dumps({"prompt": prompt, **completion}), flush=True)
    else:
        print(completion["text"], flush=True)


class TokenPrinter:
    """Prints a completion as its tokens arrive (what `StreamedText` makes certain), and the rest
    of the final text (stop string cut) at the end."""

    def __init__(self, interface, stop: Sequence[StopItem]):
        self.text = StreamedText(interface.tokenizer.decode, interface.special_ids(),
                                 [s for s in stop if isinstance(s, str)])

    def __call__(self, prompt_index: int, token: int) -> None:
        sys.stdout.write(self.text.push(token))
        sys.stdout.flush()

    def finish(self, final_text: str) -> None:
        sys.stdout.write(self.text.rest(final_text) + "\n")
        sys.stdout.flush()


def run_interactive(interface, options: GenerationOptions, output_format: str) -> None:
    streaming = output_format == "text" and options.n == 1 and options.best_of == 1 and not options.echo
    print("Type a prompt and press Enter (Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if not prompt.strip():
            continue
        try:
            if streaming:
                printer = TokenPrinter(interface, options.stop)
                [[completion]] = interface.generate([prompt], stream=printer, options=options)
                printer.finish(completion["text"])
            else:
                for completion in interface.generate([prompt], options=options)[0]:
                    print_result(prompt, completion, output_format)
        except UsageError as error:  # a bad prompt should not end the session
            print(f"error: {error}", file=sys.stderr)


if __name__ == "__main__":
    run_alone("generate", command, sys.argv[1:])
