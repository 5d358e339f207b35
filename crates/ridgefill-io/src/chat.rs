//! Chat templates (HF Jinja) rendered with minijinja, configured like transformers' sandbox.

use std::path::{Path, PathBuf};

use minijinja::value::Value;
use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::error::{IoError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// Name the template is registered under inside its environment.
const TEMPLATE_NAME: &str = "chat_template";
/// Origin reported in errors for templates built from a bare string.
const INLINE_ORIGIN: &str = "<chat template>";
/// Instructions one render may execute: real chat templates need a few hundred per message,
/// so this allows conversations of thousands of turns while a runaway loop stops in well under a second.
pub const RENDER_FUEL: u64 = 5_000_000;
/// Nesting (loops, ifs, macro calls, includes) a render may reach; real templates stay below 10.
pub const RECURSION_LIMIT: usize = 100;
/// Nesting `tojson` follows, and values stored in namespaces may have, before giving up.
pub const TOJSON_MAX_DEPTH: usize = 128;
/// Function wrapped around the right-hand side of every `{% set ns.attr = ... %}`.
const STORE_GUARD: &str = "__ridgefill_store";
/// Items [`STORE_GUARD`] may inspect in one render before giving up.
const STORE_WALK_BUDGET: usize = 1_000_000;

thread_local! {
    /// Items [`STORE_GUARD`] has inspected in the render running on this thread.
    static STORE_WALKED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// GGUF key holding the Jinja chat template.
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// Gemma 3's chat template, verbatim from google/gemma-3-*-it `tokenizer_config.json`; llama.cpp's
/// Gemma 3 GGUFs (e.g. the 270M base model) often carry none.
pub const GEMMA3_CHAT_TEMPLATE: &str = include_str!("templates/gemma3.jinja");

/// The template RidgeFill ships for an architecture (`general.architecture` of a GGUF, or
/// `model_type` of a HF config) whose files often lack one.
pub fn builtin_template(architecture: &str) -> Option<&'static str> {
    match architecture {
        "gemma3" | "gemma3_text" => Some(GEMMA3_CHAT_TEMPLATE),
        _ => None,
    }
}

/// A GGUF's chat template: `tokenizer.chat_template`, else the built-in one for its architecture
/// ([`builtin_template`]), else `None`. `bos_token` / `eos_token` are the texts of the tokenizer's
/// BOS and of `eos_id` (the first EOS id when `None`).
pub fn gguf_template(
    file: &GgufFile,
    tokenizer: &Tokenizer,
    eos_id: Option<u32>,
) -> Result<Option<ChatTemplate>> {
    let text = |id: Option<u32>| {
        id.and_then(|i| tokenizer.id_to_token(i))
            .unwrap_or_default()
    };
    let bos = text(tokenizer.bos_id());
    let eos = text(eos_id.or_else(|| tokenizer.eos_ids().first().copied()));
    if let Some(src) = file.opt_str(KEY_CHAT_TEMPLATE)? {
        return ChatTemplate::with_origin(src.to_string(), bos, eos, file.path()).map(Some);
    }
    let arch = file.opt_str("general.architecture")?.unwrap_or_default();
    match builtin_template(arch) {
        Some(src) => {
            let origin = format!(
                "{} (no {KEY_CHAT_TEMPLATE}: built-in {arch} template)",
                file.path().display()
            );
            ChatTemplate::with_origin(src.to_string(), bos, eos, Path::new(&origin)).map(Some)
        }
        None => Ok(None),
    }
}

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// Convenience constructor.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
    origin: PathBuf,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `src`; `bos`/`eos` are exposed to the template as `bos_token`/`eos_token`.
    pub fn new(src: String, bos: String, eos: String) -> Result<ChatTemplate> {
        Self::with_origin(src, bos, eos, Path::new(INLINE_ORIGIN))
    }

    /// Like [`Self::new`], naming the file the template came from in errors.
    pub fn with_origin(
        src: String,
        bos: String,
        eos: String,
        origin: &Path,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        // transformers compiles chat templates with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Templates come from model files: bound the work and the nesting of one render.
        env.set_fuel(Some(RENDER_FUEL));
        env.set_recursion_limit(RECURSION_LIMIT);
        // Python string/dict methods (.strip(), .startswith(), .items(), ...) used by HF templates.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(STORE_GUARD, store_guard);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: String| {
            crate::date::strftime_now(&fmt)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, guard_namespace_stores(&src))
            .map_err(|e| IoError::Template {
                path: origin.to_path_buf(),
                message: format!("template does not compile: {}", describe(&e)),
            })?;
        Ok(ChatTemplate {
            env,
            source: src,
            bos,
            eos,
            origin: origin.to_path_buf(),
        })
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation into the prompt text.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, Value::UNDEFINED)
    }

    /// Renders with extra template variables (e.g. `tools`, `date_string`) merged in.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: Value,
    ) -> Result<String> {
        let fail = |e: JinjaError| IoError::Template {
            path: self.origin.clone(),
            message: describe(&e),
        };
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(fail)?;
        let base = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        };
        STORE_WALKED.with(|w| w.set(0));
        let ctx = if extra.is_undefined() {
            base
        } else {
            context! { ..base, ..extra }
        };
        tmpl.render(ctx).map_err(fail)
    }
}

fn describe(e: &JinjaError) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// Wraps the value of every `{% set a.b = value %}` in [`STORE_GUARD`].
///
/// A namespace stored inside a namespace can come to contain itself, and minijinja's printing,
/// comparison and sorting then recurse until the stack overflows (an abort, not an error). Only
/// `set` assigns attributes, so guarding its right-hand side keeps every namespace acyclic.
fn guard_namespace_stores(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        match dotted_set_value(tag) {
            Some((value_start, value_end)) => {
                out.push_str(&tag[..value_start]);
                out.push_str(&format!(" {STORE_GUARD}(("));
                out.push_str(&tag[value_start..value_end]);
                out.push_str("))");
                rest = &tag[value_end..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// For a tag starting `{% set <targets with a dot> = value %}`, the byte range of `value`.
fn dotted_set_value(tag: &str) -> Option<(usize, usize)> {
    let after = &tag[2..];
    let after = after.strip_prefix(['-', '+']).unwrap_or(after).trim_start();
    let targets_and_value = after.strip_prefix("set")?;
    if !targets_and_value.starts_with(char::is_whitespace) {
        return None;
    }
    let eq = targets_and_value.find('=')?;
    let targets = &targets_and_value[..eq];
    let target_char = |c: char| c.is_alphanumeric() || "_.,() \t\r\n".contains(c);
    if !targets.contains('.') || !targets.chars().all(target_char) {
        return None;
    }
    let value_start = tag.len() - targets_and_value.len() + eq + 1;
    if tag[value_start..].starts_with('=') {
        return None;
    }
    let len = block_value_len(&tag[value_start..])?;
    Some((value_start, value_start + len))
}

/// Length of a block's expression: up to its `%}` (or `-%}`) outside string literals.
fn block_value_len(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut quote = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match quote {
            Some(_) if b == b'\\' => i += 1,
            Some(q) if b == q => quote = None,
            Some(_) => {}
            None if b == b'\'' || b == b'"' => quote = Some(b),
            None if bytes[i..].starts_with(b"%}") => {
                let trimmed = i > 0 && matches!(bytes[i - 1], b'-' | b'+');
                return Some(if trimmed { i - 1 } else { i });
            }
            None => {}
        }
        i += 1;
    }
    None
}

/// `__ridgefill_store(value)`: `value` unchanged, unless it holds a namespace.
fn store_guard(value: Value) -> std::result::Result<Value, JinjaError> {
    let namespace_type = minijinja::functions::namespace(None)?
        .as_object()
        .map(|o| o.type_name());
    check_no_namespace(&value, namespace_type, 0)?;
    Ok(value)
}

fn check_no_namespace(
    v: &Value,
    namespace_type: Option<&'static str>,
    depth: usize,
) -> std::result::Result<(), JinjaError> {
    use minijinja::value::ValueKind;
    if depth >= TOJSON_MAX_DEPTH {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("values stored in namespaces may nest at most {TOJSON_MAX_DEPTH} levels"),
        ));
    }
    let walked = STORE_WALKED.with(|w| {
        let n = w.get() + 1;
        w.set(n);
        n
    });
    if walked > STORE_WALK_BUDGET {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("values stored in namespaces hold more than {STORE_WALK_BUDGET} items in all"),
        ));
    }
    let Some(obj) = v.as_object() else {
        return Ok(());
    };
    if Some(obj.type_name()) == namespace_type {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            "a namespace cannot be stored inside a namespace (it could come to contain itself)",
        ));
    }
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            for item in v.try_iter()? {
                check_no_namespace(&item, namespace_type, depth + 1)?;
            }
        }
        ValueKind::Map => {
            for key in v.try_iter()? {
                check_no_namespace(&v.get_item(&key)?, namespace_type, depth + 1)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// HF templates call `raise_exception(msg)` to reject a conversation.
fn raise_exception(msg: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(
        ErrorKind::InvalidOperation,
        format!("template raised an exception: {msg}"),
    ))
}

/// Python-compatible `tojson`: `json.dumps` separators, key order kept, no HTML escaping.
fn tojson(
    value: Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_py_json(&mut out, &value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_py_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    level: usize,
) -> std::result::Result<(), JinjaError> {
    use minijinja::value::ValueKind;
    if level >= TOJSON_MAX_DEPTH {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: value nested deeper than {TOJSON_MAX_DEPTH} levels (or containing itself)"
            ),
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    let json_err =
        |e: serde_json::Error| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}"));
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let is_map = v.kind() == ValueKind::Map;
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str(if is_map { "{}" } else { "[]" });
                return Ok(());
            }
            out.push(if is_map { '{' } else { '[' });
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                if is_map {
                    let key = x
                        .as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| x.to_string());
                    out.push_str(&serde_json::to_string(&key).map_err(json_err)?);
                    out.push_str(": ");
                    write_py_json(out, &v.get_item(x)?, indent, level + 1)?;
                } else {
                    write_py_json(out, x, indent, level + 1)?;
                }
            }
            newline(out, level);
            out.push(if is_map { '}' } else { ']' });
        }
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        _ => out.push_str(&serde_json::to_string(v).map_err(json_err)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_with_python_methods_and_errors() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad') }}{% endif %}\
             {{ m.content.strip() }}{% if m.content.strip().startswith('x') %}!{% endif %}{% endfor %}\
             {{ {'a': [1, 2]} | tojson }}"
                .into(),
            "<s>".into(),
            "</s>".into(),
        )
        .unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  xy ")], false)
            .unwrap();
        assert_eq!(out, "xy!{\"a\": [1, 2]}");
        let err = t.render(&[ChatMessage::new("bad", "")], false).unwrap_err();
        assert!(err.to_string().contains("no bad"), "{err}");
    }
}
