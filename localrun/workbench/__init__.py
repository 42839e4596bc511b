"""The workbench: tools that measure models rather than run them.

bench (llama-bench's speed tests), perplexity (llama-perplexity's scores and KL divergence),
imatrix (llama-imatrix's importance matrices), ladder (many quantizations of one model, each
measured) and texts (the text sets they use). They open llama.cpp through the engine's loader
(backends/llama_loader.py) and run in a child process through the one isolation runner
(backends/isolation.py); front ends reach them through localrun.api.
"""
