"""Images in prompts: preprocessing (qwen_vl_image), the per-image record a request carries
(inputs), placeholder expansion and validation (processor), M-RoPE positions (mrope), and
fetching images named by URL (media)."""
