"""Tensor parallelism: each decoder layer, the embedding and the head split over the tensor-parallel ranks by the
model's own plan. `plan.py` applies it with torch's DTensor APIs under FSDP2 and inside pipeline stages, with
Megatron's sequence parallelism between the regions; `vocab.py` is the head split by vocabulary rows and its loss;
`checks.py` refuses what cannot split and reads back what is in force (DeepSpeed AutoTP's too)."""
