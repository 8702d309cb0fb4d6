"""`mseq serve`: metaseq's hosted completions API (`metaseq/cli/interactive_hosted.py`), which
is OpenAI's, on FastAPI + uvicorn.

- `protocol`: request and response schema (OpenAI's), one-line errors naming the field;
- `completions`: a request -> a batcher job (prompts encoded and checked) -> a response or events;
- `batcher`: groups waiting requests into decoding batches under a token budget;
- `runner`: decodes a batch with `GeneratorInterface`, on one process or all ranks of a launch;
- `app`: the routes, API key, body size limit.
`metaseq_ds.cli.serve` wires them together.
"""
