//! `rust-block-manager`: an example KV cache manager that kvconform tests through its exec
//! protocol (`docs/exec-protocol.md`, version 1): one JSON message per line on stdin, one
//! answer per line on stdout, diagnostics on stderr.
//!
//! ```text
//! -> {"id": 1, "call": "hello", "args": {"protocol": 1}}
//! <- {"id": 1, "result": {"protocol": 1, "name": "rust-block-manager", ...}}
//! -> {"id": 2, "call": "create", "args": {"layout": {...}}}
//! <- {"id": 2, "result": {"capabilities": ["ref_counts", "free_queue", "cached_blocks"]}}
//! -> {"id": 3, "call": "num_free_blocks", "args": {}}
//! <- {"id": 3, "result": 15}
//! ```
//!
//! Usage: `kvconform check --engine exec:path/to/rust-block-manager --level universal`.

mod json;
mod manager;
mod pool;

use std::io::{self, BufRead, Write};

use json::{object, Json};
use manager::{Attention, CallError, Group, Hit, Layout, Manager};

const PROTOCOL: i64 = 1;

/// What went wrong with one message: the error `kind` of the protocol and a message.
struct Failure {
    kind: &'static str,
    message: String,
}

impl From<CallError> for Failure {
    fn from(e: CallError) -> Failure {
        Failure {
            kind: "engine_error",
            message: e.0,
        }
    }
}

fn protocol_error<T>(message: String) -> Result<T, Failure> {
    Err(Failure {
        kind: "protocol_error",
        message,
    })
}

fn arg<'a>(args: &'a Json, name: &str) -> Result<&'a Json, Failure> {
    match args.get(name) {
        Some(v) => Ok(v),
        None => protocol_error(format!("missing argument {name:?}")),
    }
}

fn usize_arg(args: &Json, name: &str) -> Result<usize, Failure> {
    match arg(args, name)?.as_i64() {
        Some(v) if v >= 0 => Ok(v as usize),
        _ => protocol_error(format!("argument {name:?} must be an integer >= 0")),
    }
}

fn str_arg<'a>(args: &'a Json, name: &str) -> Result<&'a str, Failure> {
    match arg(args, name)?.as_str() {
        Some(s) => Ok(s),
        None => protocol_error(format!("argument {name:?} must be a string")),
    }
}

fn optional_str_arg(args: &Json, name: &str) -> Result<Option<String>, Failure> {
    match args.get(name) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Str(s)) => Ok(Some(s.clone())),
        Some(_) => protocol_error(format!("argument {name:?} must be a string or null")),
    }
}

fn token_list(value: &Json, name: &str) -> Result<Vec<i64>, Failure> {
    let Some(items) = value.as_array() else {
        return protocol_error(format!("argument {name:?} must be a list of token ids"));
    };
    items
        .iter()
        .map(|t| match t.as_i64() {
            Some(v) => Ok(v),
            None => protocol_error(format!("argument {name:?} holds a non-integer token")),
        })
        .collect()
}

fn block_table(value: &Json, name: &str) -> Result<Vec<Vec<usize>>, Failure> {
    let bad = || protocol_error(format!("{name} must be a list of lists of block ids"));
    let Some(groups) = value.as_array() else {
        return bad();
    };
    let mut out = Vec::with_capacity(groups.len());
    for g in groups {
        let Some(ids) = g.as_array() else {
            return bad();
        };
        let mut row = Vec::with_capacity(ids.len());
        for b in ids {
            match b.as_i64() {
                Some(v) if v >= 0 => row.push(v as usize),
                _ => return bad(),
            }
        }
        out.push(row);
    }
    Ok(out)
}

fn ids_json(ids: &[usize]) -> Json {
    Json::Array(ids.iter().map(|&b| Json::Int(b as i64)).collect())
}

fn table_json(table: &[Vec<usize>]) -> Json {
    Json::Array(table.iter().map(|row| ids_json(row)).collect())
}

/// The layout of a `create` message (the trace format's layout object).
fn parse_layout(value: &Json) -> Result<Layout, Failure> {
    let int = |v: Option<&Json>, what: &str| -> Result<usize, Failure> {
        match v.and_then(Json::as_i64) {
            Some(x) if x >= 0 => Ok(x as usize),
            _ => protocol_error(format!("layout.{what} must be an integer >= 0")),
        }
    };
    let num_blocks = int(value.get("num_blocks"), "num_blocks")?;
    let max_model_len = int(value.get("max_model_len"), "max_model_len")?;
    let enable_caching = value
        .get("enable_caching")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    let Some(groups) = value.get("groups").and_then(Json::as_array) else {
        return protocol_error("layout.groups must be a list".into());
    };
    let mut out = Vec::new();
    for (gid, g) in groups.iter().enumerate() {
        let spec = g.get("spec").unwrap_or(&Json::Null);
        let kind = spec.get("type").and_then(Json::as_str).unwrap_or("");
        let block_size = int(
            spec.get("block_size"),
            &format!("groups[{gid}].spec.block_size"),
        )?;
        let attention = match kind {
            "full" => Attention::Full,
            "sliding_window" => Attention::SlidingWindow {
                window: int(spec.get("sliding_window"), &format!("groups[{gid}].spec.sliding_window"))?,
            },
            other => {
                return Err(Failure {
                    kind: "unsupported_layout",
                    message: format!(
                        "group {gid} is {other:?} attention; this engine supports full and sliding_window"
                    ),
                })
            }
        };
        out.push(Group {
            block_size,
            attention,
        });
    }
    Ok(Layout {
        num_blocks,
        max_model_len,
        enable_caching,
        groups: out,
    })
}

fn parse_hit(value: &Json) -> Result<Option<Hit>, Failure> {
    if value.is_null() {
        return Ok(None);
    }
    let num_tokens = usize_arg(value, "num_tokens")?;
    let block_ids = block_table(arg(value, "block_ids")?, "hit.block_ids")?;
    Ok(Some(Hit {
        num_tokens,
        block_ids,
    }))
}

struct Server {
    manager: Option<Manager>,
}

impl Server {
    fn manager(&mut self) -> Result<&mut Manager, Failure> {
        match self.manager.as_mut() {
            Some(m) => Ok(m),
            None => protocol_error("no engine yet: send \"create\" first".into()),
        }
    }

    fn handle(&mut self, call: &str, args: &Json) -> Result<Json, Failure> {
        match call {
            "hello" => {
                let version = args.get("protocol").and_then(Json::as_i64);
                if version != Some(PROTOCOL) {
                    return protocol_error(format!(
                        "this engine speaks protocol {PROTOCOL}, the client asked for {version:?}"
                    ));
                }
                let strings = |items: &[&str]| {
                    Json::Array(items.iter().map(|s| Json::Str(s.to_string())).collect())
                };
                Ok(object(vec![
                    ("protocol", Json::Int(PROTOCOL)),
                    ("name", Json::Str("rust-block-manager".into())),
                    ("spec_types", strings(&["full", "sliding_window"])),
                ]))
            }
            "create" => {
                let layout = parse_layout(arg(args, "layout")?)?;
                self.manager = Some(Manager::new(layout)?);
                let caps = ["ref_counts", "free_queue", "cached_blocks"];
                Ok(object(vec![(
                    "capabilities",
                    Json::Array(caps.iter().map(|c| Json::Str(c.to_string())).collect()),
                )]))
            }
            "add_request" => {
                let tokens = token_list(arg(args, "prompt_token_ids")?, "prompt_token_ids")?;
                let salt = optional_str_arg(args, "cache_salt")?;
                let lora = optional_str_arg(args, "lora_name")?;
                let id = str_arg(args, "request_id")?.to_string();
                self.manager()?.add_request(&id, tokens, salt, lora)?;
                Ok(Json::Null)
            }
            "append_output_tokens" => {
                let tokens = token_list(arg(args, "token_ids")?, "token_ids")?;
                let id = str_arg(args, "request_id")?.to_string();
                self.manager()?.append_output_tokens(&id, &tokens)?;
                Ok(Json::Null)
            }
            "set_num_computed_tokens" => {
                let n = usize_arg(args, "num_computed_tokens")?;
                let id = str_arg(args, "request_id")?.to_string();
                self.manager()?.set_num_computed_tokens(&id, n)?;
                Ok(Json::Null)
            }
            "shutdown" => Ok(Json::Null),
            "new_step" => {
                self.manager()?;
                Ok(Json::Null)
            }
            "get_computed_blocks" => {
                let id = str_arg(args, "request_id")?.to_string();
                let hit = self.manager()?.get_computed_blocks(&id)?;
                Ok(object(vec![
                    ("num_tokens", Json::Int(hit.num_tokens as i64)),
                    ("block_ids", table_json(&hit.block_ids)),
                ]))
            }
            "allocate_slots" => {
                let id = str_arg(args, "request_id")?.to_string();
                let n = usize_arg(args, "num_new_tokens")?;
                let n_hit = usize_arg(args, "num_new_computed_tokens")?;
                let lookahead = usize_arg(args, "num_lookahead_tokens")?;
                let hit = parse_hit(args.get("hit").unwrap_or(&Json::Null))?;
                match self
                    .manager()?
                    .allocate_slots(&id, n, n_hit, hit, lookahead)?
                {
                    Some(new) => Ok(table_json(&new)),
                    None => Ok(Json::Null),
                }
            }
            "free" => {
                let id = str_arg(args, "request_id")?.to_string();
                self.manager()?.free(&id)?;
                Ok(Json::Null)
            }
            "remove_request" => {
                let id = str_arg(args, "request_id")?.to_string();
                self.manager()?.remove_request(&id)?;
                Ok(Json::Null)
            }
            "reset_prefix_cache" => Ok(Json::Bool(self.manager()?.reset_prefix_cache())),
            "get_block_ids" => {
                let id = str_arg(args, "request_id")?.to_string();
                Ok(table_json(&self.manager()?.get_block_ids(&id)?))
            }
            "num_free_blocks" => Ok(Json::Int(self.manager()?.num_free_blocks() as i64)),
            "ref_counts" => Ok(Json::Array(
                self.manager()?
                    .ref_counts()
                    .into_iter()
                    .map(|(b, c)| Json::Array(vec![Json::Int(b as i64), Json::Int(c as i64)]))
                    .collect(),
            )),
            "free_queue" => Ok(ids_json(&self.manager()?.free_queue())),
            "cached_blocks" => Ok(Json::Array(
                self.manager()?
                    .cached_blocks()
                    .into_iter()
                    .map(|(b, e)| {
                        Json::Array(vec![
                            Json::Int(b as i64),
                            Json::Int(e.group as i64),
                            Json::Int(e.num_tokens as i64),
                        ])
                    })
                    .collect(),
            )),
            other => protocol_error(format!("unknown call {other:?}")),
        }
    }
}

fn answer(id: Json, outcome: Result<Json, Failure>) -> Json {
    match outcome {
        Ok(result) => object(vec![("id", id), ("result", result)]),
        Err(f) => object(vec![
            ("id", id),
            (
                "error",
                object(vec![
                    ("kind", Json::Str(f.kind.into())),
                    ("message", Json::Str(f.message)),
                ]),
            ),
        ]),
    }
}

fn main() {
    let stdin = io::stdin();
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut server = Server { manager: None };
    for line in stdin.lock().lines() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                eprintln!("rust-block-manager: cannot read stdin: {e}");
                std::process::exit(1);
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let (id, call, reply) = match json::parse(&line) {
            Err(e) => (
                Json::Null,
                String::new(),
                protocol_error(format!("invalid JSON: {e}")),
            ),
            Ok(msg) => {
                let id = msg.get("id").cloned().unwrap_or(Json::Null);
                match msg.get("call").and_then(Json::as_str) {
                    None => (
                        id,
                        String::new(),
                        protocol_error("a message needs a string \"call\"".into()),
                    ),
                    Some(call) => {
                        let empty = Json::Object(Default::default());
                        let args = msg.get("args").unwrap_or(&empty);
                        let reply = server.handle(call, args);
                        (id, call.to_string(), reply)
                    }
                }
            }
        };
        let text = answer(id, reply).to_text();
        if writeln!(out, "{text}").and_then(|_| out.flush()).is_err() {
            std::process::exit(1); // the client went away
        }
        if call == "shutdown" {
            break;
        }
    }
}
