"""Bridge a real vLLM engine into kvgate, without patching vLLM.

vLLM publishes its prefix-cache changes over ZMQ (``--kv-events-config``) as token ids; kvgate
routes on bytes. The bridge decodes vLLM's messages (:mod:`.wire`), maps each cached block's
token ids to the exact prompt bytes with the model's own tokenizer (:mod:`.tokens`), rechains
them with kvgate's block hash (:mod:`.translate`), follows vLLM's sequence numbers and replay
socket (:mod:`.sequence`), turns vLLM's Prometheus ``/metrics`` into load heartbeats
(:mod:`.metrics`), and publishes everything through :class:`engine_reporter.Reporter`
(:mod:`.bridge`, the only module doing I/O). ``kvgate bridge vllm`` is in :mod:`.cli`.
"""
