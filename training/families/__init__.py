"""Model families: each module owns one family's weight names in Hugging Face and GGUF files (both ways),
so that importers and exporters are generic loops over its table."""
