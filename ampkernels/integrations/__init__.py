"""Integrations with other libraries (Hugging Face transformers, ...). Each module imports its
library lazily: `import ampkernels` never imports them."""
