"""manas export --format hf: a checkpoint (or a GGUF file) as a Hugging Face folder, a layer at a time: the files
transformers, vLLM and TGI read (huggingface.py's layouts and tokenizer files), the weights streamed by
checkpoint_writer.py from model_tensors.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .checkpoint_writer import write_safetensors
from .huggingface import Exported, check_out_dir, hf_twin, json_text, tokenizer_files, write_folder
from .model_tensors import model_tensors
from .tokenizer import bos_id, end_of_text_id


def export_hf(checkpoint_path: Path, out: Path, *, force: bool = False) -> Exported:
    """Write checkpoint_path (a manas checkpoint or a GGUF file) as a Hugging Face folder, a layer at a time
    (model_tensors.py: quantized weights export dequantized to float); refuse before writing anything it cannot
    export."""
    if out.is_symlink() and out.is_dir():
        out = out.resolve()  # write into the folder the link names, as the user would (a rename would hit the link)
    check_out_dir(out, force, checkpoint_path)
    model = model_tensors(checkpoint_path)
    config = model.config
    texts = tokenizer_files(model.encoding, config.block_size, checkpoint_path)
    # The model's own ends: the token that ends its texts or turns (<|im_end|> for an instruct model), and its BOS
    end_of_text = end_of_text_id(model.encoding)
    bos = bos_id(model.encoding)
    architecture, model_config, to_hf = hf_twin(config, model.dtype, end_of_text, checkpoint_path)
    generation = {"bos_token_id": end_of_text if bos is None else bos, "eos_token_id": end_of_text}
    texts |= {"config.json": json_text(model_config), "generation_config.json": json_text(generation)}
    if template := model.metadata.get("chat_template"):  # transformers and vLLM chat in its format
        texts["tokenizer_config.json"] = json_text(
            json.loads(texts["tokenizer_config.json"]) | {"chat_template": template}
        )
    writers: dict[str, Callable[[Path], None]] = {
        name: (lambda path, text=text: path.write_text(text, encoding="utf-8")) for name, text in texts.items()
    }

    def weights(path: Path) -> None:
        planned = (to_hf(config, group) for group in model.groups(meta=True))
        write_safetensors(path, planned, (to_hf(config, group) for group in model.groups()), {"format": "pt"},
                          checkpoint_path)  # fmt: skip

    writers["model.safetensors"] = weights
    write_folder(out, writers, overwrite=force)
    return Exported(out, sorted(writers), config, architecture)
