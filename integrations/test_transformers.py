"""Every transformers family with multi-scale deformable attention, built tiny from a config with random weights:
msda_core.patch(model) must give the model's own PyTorch path's outputs and parameter gradients in float64
(equivalence.py), through the mechanism the family needs."""

import msda_core
import pytest
import torch
import transformers as T
from equivalence import check_patched_equals_unpatched

IMAGE_SIZE = 64  # strides 8, 16, 32: levels of 8x8, 4x4 and 2x2


def _image():
    return torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))


def _ids(*shape):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(0))


def _resnet():
    return T.ResNetConfig(embeddings_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], hidden_act="relu",
                          out_features=["stage2", "stage3", "stage4"])


def _hgnet(out_features=("stage2", "stage3", "stage4")):
    return T.HGNetV2Config(embedding_size=8, depths=[1, 1, 1, 1], hidden_sizes=[16, 16, 32, 32],
                           stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 16, 32], stage_mid_channels=[8, 8, 8, 8],
                           stage_out_channels=[16, 16, 32, 32], stage_num_blocks=[1, 1, 1, 1],
                           stage_light_block=[False, False, True, True], stage_kernel_size=[3, 3, 3, 3],
                           stage_numb_of_layers=[1, 1, 1, 1], out_features=list(out_features))


def _swin():
    return T.SwinConfig(image_size=IMAGE_SIZE, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4,
                        out_features=["stage1", "stage2", "stage3", "stage4"])


def _bert():
    return T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=64)


# Deformable DETR and its descendants: a deformable encoder and decoder; GroupNorm(32) needs d_model 32.
DETR = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5, num_feature_levels=3, encoder_n_points=2,
            decoder_n_points=2, backbone_config=_resnet())
# RT-DETR and its descendants: a hybrid encoder, a deformable decoder.
RT_DETR = dict(backbone_config=_hgnet(), encoder_hidden_dim=32, encoder_in_channels=[16, 32, 32], encoder_ffn_dim=32,
               encoder_attention_heads=2, d_model=32, num_queries=5, decoder_in_channels=[32, 32, 32],
               decoder_ffn_dim=32, decoder_n_points=2, decoder_layers=1, decoder_attention_heads=2, num_denoising=0)
VIT_DETR = dict(d_model=32, projector_scale_factors=[0.5, 2.0], decoder_ffn_dim=32, decoder_layers=1,
                decoder_self_attention_heads=2, decoder_cross_attention_heads=2, decoder_n_points=2, num_queries=5,
                group_detr=1)


def _omdet_turbo():
    text = dict(model_type="clip_text_model", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=16, max_position_embeddings=8, vocab_size=64, bos_token_id=0, eos_token_id=1)
    swin = dict(model_type="swin", embed_dim=8, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4,
                image_size=IMAGE_SIZE, out_indices=(2, 3, 4))
    # class_embed_dim differs from decoder_hidden_dim: 5.24 defines task_project only then, and always calls it
    config = T.OmDetTurboConfig(
        text_config=text, backbone_config=swin, use_timm_backbone=False, image_size=IMAGE_SIZE,
        apply_layernorm_after_vision_backbone=False, encoder_in_channels=(16, 32, 64), decoder_num_layers=1,
        num_queries=5, encoder_layers=1, encoder_attention_heads=2, decoder_num_heads=2, decoder_num_points=2,
        encoder_dim_feedforward=16, task_encoder_hidden_dim=16, decoder_dim_feedforward=16, class_embed_dim=32,
        text_projection_in_dim=32, text_projection_out_dim=32, encoder_hidden_dim=16, decoder_hidden_dim=16,
        vision_features_channels=[16, 16, 16])
    model = T.OmDetTurboForObjectDetection(config)
    model.register_forward_pre_hook(_empty_language_caches)
    ids = _ids(2, 7)
    return model, dict(
        pixel_values=_image(), classes_input_ids=ids, classes_attention_mask=torch.ones_like(ids),
        tasks_input_ids=ids[:1], tasks_attention_mask=torch.ones_like(ids[:1]), classes_structure=torch.tensor([2]))


def _empty_language_caches(model, args):
    """OmDet-Turbo caches text embeddings across forwards (and their graphs): each run must make its own."""
    for cache in (model.language_cache_class, model.language_cache_prompt):
        cache.cache.clear()
        cache.current_load = 0


FAMILIES = {  # family -> (builder of (model, inputs), the mechanism patch must use)
    "deformable_detr": (lambda: (T.DeformableDetrModel(T.DeformableDetrConfig(**DETR, use_timm_backbone=False)),
                                 dict(pixel_values=_image())), "child"),
    "grounding_dino": (lambda: (T.GroundingDinoModel(T.GroundingDinoConfig(**DETR, text_config=_bert(),
                                                                            max_text_len=8)),
                                dict(pixel_values=_image(), input_ids=_ids(1, 6))), "child"),
    "mm_grounding_dino": (lambda: (T.MMGroundingDinoModel(T.MMGroundingDinoConfig(**DETR, text_config=_bert(),
                                                                                  max_text_len=8)),
                                   dict(pixel_values=_image(), input_ids=_ids(1, 6))), "child"),
    "lw_detr": (lambda: (T.LwDetrModel(T.LwDetrConfig(**VIT_DETR, backbone_config=T.LwDetrViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, window_block_indices=[0], out_indices=[1, 2],
        num_windows=16, image_size=IMAGE_SIZE))), dict(pixel_values=_image())), "child"),
    "rf_detr": (lambda: (T.RfDetrModel(T.RfDetrConfig(**VIT_DETR, backbone_config=T.RfDetrDinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, out_features=["stage1", "stage2"], patch_size=16,
        num_windows=2, image_size=IMAGE_SIZE))), dict(pixel_values=_image())), "child"),
    "rt_detr": (lambda: (T.RTDetrModel(T.RTDetrConfig(**RT_DETR)), dict(pixel_values=_image())), "child"),
    "omdet_turbo": (_omdet_turbo, "child"),
    "pp_doclayout_v2": (lambda: (T.PPDocLayoutV2Model(T.PPDocLayoutV2Config(**RT_DETR)),
                                 dict(pixel_values=_image())), "child"),
    "pp_doclayout_v3": (lambda: (T.PPDocLayoutV3Model(T.PPDocLayoutV3Config(**{
        **RT_DETR, "backbone_config": _hgnet(("stage1", "stage2", "stage3", "stage4"))}, x4_feat_dim=16,
        mask_feature_channels=[16, 16], num_prototypes=8)), dict(pixel_values=_image())), "child"),
    "pp_doclayout_v4": (lambda: (T.PPDocLayoutV4Model(T.PPDocLayoutV4Config(**RT_DETR)),
                                 dict(pixel_values=_image())), "child"),
    "mask2former": (lambda: (T.Mask2FormerModel(T.Mask2FormerConfig(
        backbone_config=_swin(), feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32,
        encoder_layers=1, decoder_layers=2, num_attention_heads=2, dim_feedforward=32, num_queries=5)),
        dict(pixel_values=_image())), "global"),
    "oneformer": (lambda: (T.OneFormerModel(T.OneFormerConfig(
        backbone_config=_swin(), conv_dim=32, mask_dim=32, hidden_dim=32, encoder_feedforward_dim=32, encoder_layers=1,
        decoder_layers=2, num_attention_heads=2, dim_feedforward=32, num_queries=5, text_encoder_width=32,
        text_encoder_num_layers=1, text_encoder_context_length=8, task_seq_len=8, text_encoder_vocab_size=64,
        query_dec_layers=1)), dict(pixel_values=_image(), task_inputs=_ids(1, 8))), "global"),
    "rt_detr_v2": (lambda: (T.RTDetrV2Model(T.RTDetrV2Config(**RT_DETR)), dict(pixel_values=_image())), "global"),
    "d_fine": (lambda: (T.DFineModel(T.DFineConfig(**RT_DETR)), dict(pixel_values=_image())), "attribute"),
    "deimv2": (lambda: (T.Deimv2Model(T.Deimv2Config(**RT_DETR)), dict(pixel_values=_image())), "attribute"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_family_equals_its_pytorch_path(family, record):
    build, mechanism = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = build()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    result = check_patched_equals_unpatched(model, inputs)
    assert result.mechanisms == [mechanism]
    record(family, result)


def test_v2_callers_with_unequal_points_are_left_alone():
    """D-FINE with 3, 1 and 2 points on its three levels: msda cannot serve it, and the report says why."""
    model = T.DFineModel(T.DFineConfig(**{**RT_DETR, "decoder_n_points": [3, 1, 2]}))
    with msda_core.patch(model) as report:
        assert not report.patched
        assert {e.reason for e in report.left_alone} == {
            "num_points_list=[3, 1, 2]: msda needs the same number of points on every level"}
