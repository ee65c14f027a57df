"""The config base (diffar/config.py): presets, (de)serialisation through JSON, validation."""

import json

import pytest

from diffar.errors import DiffarError
from diffar.models.dd2 import DD2Config
from diffar.models.refusion import RefusionConfig
from diffar.models.transformer import TransformerConfig
from diffar.models.vqvae import VQVAEConfig
from diffar.training.trainer import TrainConfig


def _through_json(cfg):
    return type(cfg).from_dict(json.loads(json.dumps(cfg.to_dict())))


def test_nested_configs_round_trip_through_json():
    dd2 = DD2Config.from_preset("tiny", VQVAEConfig.from_preset("tiny", 300), eos_id=2,
                                source_encoder=TransformerConfig.from_preset("tiny", vocab_size=300))
    back = _through_json(dd2)
    assert back == dd2 and isinstance(back.vqvae, VQVAEConfig) and isinstance(back.source_encoder, TransformerConfig)
    refusion = RefusionConfig.from_preset("tiny", 300, ar_fusion_layers=(1,))
    back = _through_json(refusion)
    assert back == refusion and isinstance(back.ar, TransformerConfig) and back.ar_fusion_layers == (1,)


def test_presets_apply_overrides_and_record_their_name():
    cfg = VQVAEConfig.from_preset("tiny", 300, groups=4)
    assert (cfg.preset, cfg.vocab_size, cfg.groups, cfg.codebook_size) == ("tiny", 300, 4, 64)
    assert RefusionConfig.from_preset("small", 300).ar.preset == "small"  # the AR stream's own preset
    with pytest.raises(DiffarError, match="unknown preset 'huge'; choose one of tiny, small"):
        VQVAEConfig.from_preset("huge", 300)


def test_from_dict_ignores_fields_it_does_not_know():
    """A checkpoint written by another diffar version may carry fields this one has dropped."""
    assert TrainConfig.from_dict({"max_steps": 5, "retired_knob": 1}) == TrainConfig(max_steps=5)


@pytest.mark.parametrize("cfg, message", [
    (lambda: TrainConfig(grad_accum=0), "grad_accum must be positive, got 0"),
    (lambda: TrainConfig(weight_decay=float("inf")), "weight_decay must be >= 0, got inf"),
    (lambda: DD2Config(semantic_weight=-0.5), "semantic_weight must be a number >= 0, got -0.5"),
    (lambda: DD2Config(vqvae={"groups": 3}), "latent width 256 must split into 3 groups"),  # nested checks run too
])
def test_failed_checks_name_the_field(cfg, message):
    with pytest.raises(DiffarError) as caught:
        cfg()
    assert str(caught.value) == message
