"""Tools for tests, examples and benchmarks: tiny models of real architectures (`factory`), of
every mlx-lm architecture for the conformance sweep (`architectures`, from `tiny_attention`,
`tiny_moe`, `tiny_recurrent`), vision-language models (`vision_factory`) and encoder
embedding models (`encoder_factory`)."""
