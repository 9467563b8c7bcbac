"""The state every rank shares (objects such as modelopt's state), written by `api.save` as objects of the
checkpoint. `COMMON_STATE_FNAME` is the file name upstream's older format used for it: a checkpoint directory
holding that file was written by upstream Megatron-Core, not here."""

COMMON_STATE_FNAME = "common.pt"
