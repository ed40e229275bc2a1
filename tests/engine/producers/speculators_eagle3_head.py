"""Writes an EAGLE-3 head with PyPI's `speculators` (an independent producer), run with the
python of its own virtualenv (scripts/setup-speculators.sh), never with ours:

    python -P speculators_eagle3_head.py VERIFIER_DIR OUT_DIR DRAFT_VOCAB AUX_LAYERS SEED

as `speculators train` builds a fresh head (Eagle3DraftModel.from_training_args with
create_transformer_layer_config: one Llama layer shaped from the verifier, the verifier's
embeddings and LM-head rows loaded), a draft vocabulary of the DRAFT_VOCAB lowest ids (t2d/d2t),
then save_pretrained. AUX_LAYERS: comma-separated target layers, e.g. "1,2,4".

The fresh head's weights are random; so that it drafts tokens a target sometimes keeps (and a
test can compare acceptance counts that are not all zero), its fc passes the last auxiliary
layer through and its layer's output projections are scaled down: it then drafts about what the
target's last auxiliary state predicts. Every weight is still the library's to write.
"""

import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config


def main(verifier: str, out: str, draft_vocab: int, aux: list[int], seed: int) -> None:
    torch.manual_seed(seed)
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier, num_layers=1, draft_arch="llama", hidden_act=None,
        sliding_window=0, full_attention_indices=[0])
    vocab = layer_config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    d2t = torch.zeros(draft_vocab, dtype=torch.long)      # draft id i is target id i
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier,
        draft_vocab_size=draft_vocab, norm_before_residual=False, ttt_steps=3,
        target_layer_ids=aux, draft_attn_impl="sdpa")
    hidden = layer_config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, (len(aux) - 1) * hidden:] = torch.eye(hidden)
        layer = model.layers[0]
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
        model.norm.weight.copy_(model.verifier_norm.weight)
    model.save_pretrained(out)


if __name__ == "__main__":
    verifier, out, draft_vocab, aux, seed = sys.argv[1:6]
    main(verifier, out, int(draft_vocab), [int(i) for i in aux.split(",")], int(seed))
