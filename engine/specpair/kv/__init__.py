"""The engine's KV caches and the steps that read and write them, one concern a module (this
package replaced static_cache.py and kv_cache.py; nothing is imported here, so importing one
module loads only what it needs):

- protocol.py: `KVCache`, the one protocol every cache implements and the decoder reads;
- choice.py: which cache and step a model runs (`kv_model`, `check_static_step`, `step_description`);
- families.py: which models the static step runs (`supports`) and their sliding windows;
- buckets.py: the bucket sizes of rows, tokens and capacity, and row grouping by width (no torch);
- static.py: `StaticKVModel`, the preallocated cache written in place (C layer or fixed step);
- paged_fixed.py: `PagedFixedKVModel`, the fixed step over a block pool through block tables;
- dynamic.py: `BatchedKVModel`, the hole-masking cache over Hugging Face's forward (fallback);
- runner.py: `StaticLlama`, the step over one model's weights (C layer, general step, fixed step);
- general_step.py: the torch layer under a boolean mask (prompts, trees, large CPU batches);
- fixed_step.py: the fixed-shape layer and its attention (CUDA, bf16; bitwise across widths);
- ops.py: the arithmetic both torch layers share (RMSNorm);
- layouts.py: `TreeLayout`, where a token tree's nodes sit;
- graphs.py: CUDA graphs recorded by the engine (`CapturedStep`, `StepGraphs`);
- compiling.py: torch.compile's settings, its kernel cache and the compiled functions;
- warmup.py: compiling and recording every bucket ahead of the first request;
- shelf.py: a released small cache kept with its graphs for the next batch of its shape.
"""
