"""Speculative decoding: propose tokens cheaply, verify them in one forward, keep the
agreed ones (drafts.py: which requests and how many; ngram.py: the proposals;
verify.py: acceptance that preserves the sampling distribution)."""
