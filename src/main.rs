//! The `tollgate` command line (DESIGN §2). A plain `fn main`: Pingora builds its own runtimes.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// jemalloc: measured +17 % req/s and -17 % p99 over glibc malloc (docs/benchmarks.md); a
/// proxy allocates and frees many small buffers per request on several threads.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use tollgate::config::{parse_duration, Config, EnvOverrides};
use tollgate::telemetry::{init_logging, LogFormat};

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "Weighted, fleet-wide rate limiting in front of an HTTP API"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value = "pretty")]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve.
    Run {
        #[arg(short, long, default_value = "gateway.yaml")]
        config: PathBuf,
        /// Also reload when the file changes (checked every second), as on SIGHUP.
        #[arg(long)]
        watch: bool,
        /// Write the process id to this file at start (and remove it at exit), for
        /// `kill -HUP "$(cat FILE)"`.
        #[arg(long)]
        pid_file: Option<PathBuf>,
    },
    /// Validate the config and print the route/cost table; exit 1 on error.
    Check {
        #[arg(short, long, default_value = "gateway.yaml")]
        config: PathBuf,
    },
    /// Show which route a request is, what it costs and which limits apply.
    Explain {
        #[arg(short, long, default_value = "gateway.yaml")]
        config: PathBuf,
        method: String,
        path: String,
        /// The API key to look up in the registry (only its hash is used).
        #[arg(long)]
        key: Option<String>,
    },
    /// Are the costs true? Merges the instances' /admin/audit and compares measured upstream
    /// time with the configured costs. Exit 2 when some instance did not answer (the others'
    /// report is printed), 1 when none did.
    Audit {
        /// The config whose costs and plans to audit (default: the instances' own).
        #[arg(short, long)]
        config: Option<PathBuf>,
        /// An instance's admin URL, e.g. http://127.0.0.1:9901; repeat for every instance.
        #[arg(long = "admin", required = true)]
        admin: Vec<String>,
        #[arg(long, value_enum, default_value = "table")]
        format: AuditFormat,
    },
    /// The gateway in front of a built-in sample API, ready to curl.
    Demo {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        #[arg(long, default_value = "127.0.0.1:9901")]
        admin_listen: String,
        #[arg(long, default_value = "127.0.0.1:3000")]
        upstream_listen: String,
    },
    /// Serve only the sample API (used by the docker-compose example).
    #[command(hide = true)]
    DemoUpstream {
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: String,
        #[arg(long, default_value = "2s", value_parser = parse_duration)]
        report_time: Duration,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AuditFormat {
    Table,
    Json,
}

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    Config::load(path, &EnvOverrides::from_env()).map_err(|errs| {
        let mut text = String::new();
        let (shown, more) = errs.shown();
        for e in shown {
            text.push_str(&format!("{e}\n"));
        }
        if more > 0 {
            text.push_str(&format!("… and {more} more\n"));
        }
        text.push_str(&format!("{}: {} error(s)\n", path.display(), errs.0.len()));
        to_stderr(&text);
        ExitCode::from(1)
    })
}

/// `TOLLGATE_ADMIN_TOKEN` as `run` would take it: `check` refuses what `run` would refuse
/// at start (a short or placeholder token).
fn admin_token_checked() -> Result<(), ExitCode> {
    tollgate::admin::token::from_env().map(drop).map_err(|e| {
        to_stderr(&format!("{e}\n"));
        ExitCode::from(1)
    })
}

/// Writes `text` to stdout and exits with `code`. print!/println! panic when the reader has
/// gone (`tollgate check | head -1`); that is not an error of the command, so it exits as it
/// would have. Other write errors are reported.
fn to_stdout(text: &str, code: ExitCode) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => code,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => code,
        Err(e) => {
            to_stderr(&format!("tollgate: cannot write to stdout: {e}\n"));
            ExitCode::from(1)
        }
    }
}

/// eprintln! panics on a closed stderr; with nowhere to report, there is nothing to do.
fn to_stderr(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

fn main() -> ExitCode {
    let code = run();
    tollgate::telemetry::flush_logs();
    code
}

fn run() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run {
            config,
            watch,
            pid_file,
        } => {
            init_logging(cli.log_format);
            serve(&config, watch, pid_file.as_deref())
        }
        Cmd::Check { config } => match (load(&config), admin_token_checked()) {
            (Ok(_), Err(code)) => code,
            (Ok(cfg), Ok(())) => {
                let text = format!(
                    "{}{}: ok\n",
                    tollgate::cli::route_table(&cfg),
                    config.display()
                );
                to_stdout(&text, ExitCode::SUCCESS)
            }
            (Err(code), _) => code,
        },
        Cmd::Explain {
            config,
            method,
            path,
            key,
        } => explain(&config, &method, &path, key.as_deref()),
        Cmd::Audit {
            config,
            admin,
            format,
        } => {
            let cfg = match config.as_deref().map(load).transpose() {
                Ok(c) => c,
                Err(code) => return code,
            };
            let (text, code) =
                tollgate::cli::audit(cfg.as_ref(), &admin, format == AuditFormat::Json);
            to_stdout(&text, ExitCode::from(code))
        }
        Cmd::Demo {
            listen,
            admin_listen,
            upstream_listen,
        } => {
            init_logging(cli.log_format);
            let code = exit_code(
                "tollgate demo",
                tollgate::cli::demo(&listen, &admin_listen, &upstream_listen),
            );
            tollgate::pid_file::remove();
            code
        }
        Cmd::DemoUpstream {
            listen,
            report_time,
        } => {
            init_logging(cli.log_format);
            exit_code(
                "tollgate demo-upstream",
                tollgate::cli::demo_upstream(&listen, report_time),
            )
        }
    }
}

/// `tollgate run`: the gateway, until it is stopped; the pid file lives as long as it does.
fn serve(config: &std::path::Path, watch: bool, pid_file: Option<&std::path::Path>) -> ExitCode {
    let cfg = match load(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(path) = pid_file {
        if let Err(e) = tollgate::pid_file::write(path) {
            to_stderr(&format!("tollgate: --pid-file {}: {e}\n", path.display()));
            return ExitCode::from(1);
        }
    }
    let code = exit_code("tollgate", tollgate::app::run(cfg, config, watch));
    tollgate::pid_file::remove();
    code
}

/// `tollgate explain`: exits 1 when the request would not be classified.
fn explain(config: &std::path::Path, method: &str, path: &str, key: Option<&str>) -> ExitCode {
    match load(config) {
        Ok(cfg) => {
            let (text, ok) = tollgate::cli::explain(&cfg, method, path, key);
            to_stdout(
                &text,
                if ok {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                },
            )
        }
        Err(code) => code,
    }
}

/// 0, or 1 with the error (and its causes) after `command: `.
fn exit_code(command: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            to_stderr(&format!("{command}: {e:#}\n"));
            ExitCode::from(1)
        }
    }
}
