"""facegate.training: quality-head training (RTS) on frozen-backbone features."""
