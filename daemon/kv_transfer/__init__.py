"""KV handoffs between daemons: llm-d's prefill/decode protocol over TCP (docs/disaggregation.md).

frames (the wire: a pull request, then one self-checking block record per block) and
service (the TCP block server of a prefill daemon, a decode daemon's pull, the leases).
"""
