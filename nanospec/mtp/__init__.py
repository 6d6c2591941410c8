"""Frozen-KV MTP speculative decoding: seeds, the draft loop, tree building, verify and acceptance."""
