//! Output shared by every benchmark: tables (aligned text and CSV), SVG plots, progress bars.
//!
//! A benchmark returns a result that implements [`Report`]: it is serialized as is for
//! `--json`, turned into [`Table`]s for the terminal and `--csv`, and into [`Plot`]s written as
//! SVG files under `--plots DIR`. Plots are plain SVG written here (no plotting dependency and
//! no fonts needed: the viewer renders the text).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// A benchmark's result: serializable for `--json`, tables for the terminal and CSV, plots.
pub trait Report: Serialize {
    /// Tables in the order they are printed.
    fn tables(&self) -> Vec<Table>;
    /// Plots worth looking at; written only with `--plots DIR`.
    fn plots(&self) -> Vec<Plot> {
        Vec::new()
    }
}

/// A titled table of strings; the first column is left-aligned, the others right-aligned.
#[derive(Clone, Debug, Default)]
pub struct Table {
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, columns: &[&str]) -> Self {
        Self {
            title: title.into(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row; missing cells are empty, extra cells are kept (and widen the table).
    pub fn row<I, S>(&mut self, cells: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    fn width(&self) -> usize {
        self.rows
            .iter()
            .map(Vec::len)
            .chain(std::iter::once(self.columns.len()))
            .max()
            .unwrap_or(0)
    }

    /// The table as aligned text: title, header, a rule, rows.
    pub fn render(&self) -> String {
        let n = self.width();
        let cell = |r: &[String], i: usize| r.get(i).map(String::as_str).unwrap_or("").to_owned();
        let mut widths = vec![0usize; n];
        for r in std::iter::once(&self.columns).chain(&self.rows) {
            for (i, w) in widths.iter_mut().enumerate() {
                *w = (*w).max(cell(r, i).chars().count());
            }
        }
        let line = |r: &[String]| {
            let mut s = String::new();
            for (i, w) in widths.iter().enumerate() {
                let c = cell(r, i);
                if i == 0 {
                    let _ = write!(s, "{c:<w$}");
                } else {
                    let _ = write!(s, "  {c:>w$}");
                }
            }
            s.trim_end().to_owned()
        };
        let mut out = String::new();
        if !self.title.is_empty() {
            out.push_str(&self.title);
            out.push('\n');
        }
        out.push_str(&line(&self.columns));
        out.push('\n');
        let rule: usize = widths.iter().sum::<usize>() + 2 * n.saturating_sub(1);
        out.push_str(&"-".repeat(rule));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }

    /// The table as CSV (RFC 4180 quoting), preceded by a `# title` comment line.
    pub fn csv(&self) -> String {
        let mut out = String::new();
        if !self.title.is_empty() {
            let _ = writeln!(out, "# {}", self.title.replace('\n', " "));
        }
        for r in std::iter::once(&self.columns).chain(&self.rows) {
            let cells: Vec<String> = r.iter().map(|c| csv_cell(c)).collect();
            out.push_str(&cells.join(","));
            out.push('\n');
        }
        out
    }
}

fn csv_cell(c: &str) -> String {
    if c.contains([',', '"', '\n', '\r']) || c.starts_with(' ') || c.ends_with(' ') {
        format!("\"{}\"", c.replace('"', "\"\""))
    } else {
        c.to_owned()
    }
}

/// What a plot draws.
#[derive(Clone, Debug)]
pub enum PlotKind {
    /// Lines through `(x, y)` points, one per series.
    Lines { series: Vec<Series>, log_x: bool },
    /// Grouped bars: one group per category, one bar per series (`values[category]`).
    Bars {
        categories: Vec<String>,
        series: Vec<(String, Vec<f64>)>,
    },
}

#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A plot, written as `<file>.svg`.
#[derive(Clone, Debug)]
pub struct Plot {
    /// File stem (letters, digits, `-`, `_`; anything else becomes `_`).
    pub file: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub kind: PlotKind,
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 62.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Round tick values covering `[lo, hi]` (about five of them).
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    if hi <= lo || !lo.is_finite() || !hi.is_finite() {
        return vec![lo];
    }
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut v = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while v <= hi + step * 1e-9 {
        out.push(v);
        v += step;
    }
    out
}

fn fmt_tick(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{}G", trim(v / 1e9))
    } else if a >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if a >= 1e4 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

impl Plot {
    /// The plot as an SVG document.
    pub fn svg(&self) -> String {
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(
            s,
            r#"<rect width="{W}" height="{H}" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
            W / 2.0,
            esc(&self.title)
        );
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 16.0,
            esc(&self.x_label),
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        let names: Vec<String> = match &self.kind {
            PlotKind::Lines { series, .. } => series.iter().map(|x| x.name.clone()).collect(),
            PlotKind::Bars { series, .. } => series.iter().map(|x| x.0.clone()).collect(),
        };
        let ys: Vec<f64> = match &self.kind {
            PlotKind::Lines { series, .. } => series
                .iter()
                .flat_map(|x| x.points.iter().map(|p| p.1))
                .collect(),
            PlotKind::Bars { series, .. } => series.iter().flat_map(|x| x.1.clone()).collect(),
        };
        let ymax = ys
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
        let ymax = if ymax > 0.0 { ymax * 1.05 } else { 1.0 };
        let ymin = ys
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::min);
        let yp = |v: f64| TOP + ph - (v - ymin) / (ymax - ymin) * ph;
        for t in ticks(ymin, ymax) {
            let y = yp(t);
            let _ = write!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                fmt_tick(t)
            );
        }
        match &self.kind {
            PlotKind::Lines { series, log_x } => {
                let tx = |x: f64| {
                    if *log_x {
                        x.max(f64::MIN_POSITIVE).log2()
                    } else {
                        x
                    }
                };
                let xs: Vec<f64> = series
                    .iter()
                    .flat_map(|x| x.points.iter().map(|p| tx(p.0)))
                    .filter(|v| v.is_finite())
                    .collect();
                let xmin = xs.iter().copied().fold(f64::INFINITY, f64::min);
                let xmax = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let (xmin, xmax) = if xmin.is_finite() && xmax > xmin {
                    (xmin, xmax)
                } else if xmin.is_finite() {
                    (xmin - 1.0, xmin + 1.0)
                } else {
                    (0.0, 1.0)
                };
                let xp = |v: f64| LEFT + (tx(v) - xmin) / (xmax - xmin) * pw;
                let xt: Vec<f64> = if *log_x {
                    (xmin.ceil() as i64..=xmax.floor() as i64)
                        .map(|e| 2f64.powi(e as i32))
                        .collect()
                } else {
                    ticks(xmin, xmax)
                };
                let step = xt.len().div_ceil(10).max(1);
                for t in xt.iter().step_by(step) {
                    let x = xp(*t);
                    let _ = write!(
                        s,
                        r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                        TOP + ph,
                        TOP + ph + 16.0,
                        if *log_x {
                            fmt_bytes_tick(*t)
                        } else {
                            fmt_tick(*t)
                        }
                    );
                }
                for (i, ser) in series.iter().enumerate() {
                    let c = COLORS[i % COLORS.len()];
                    let pts: Vec<String> = ser
                        .points
                        .iter()
                        .filter(|p| p.0.is_finite() && p.1.is_finite())
                        .map(|p| format!("{:.1},{:.1}", xp(p.0), yp(p.1)))
                        .collect();
                    let _ = write!(
                        s,
                        r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
                        pts.join(" ")
                    );
                    for p in &pts {
                        let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                        let _ = write!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{c}"/>"#);
                    }
                }
            }
            PlotKind::Bars { categories, series } => {
                let groups = categories.len().max(1) as f64;
                let gw = pw / groups;
                let bw = gw * 0.8 / series.len().max(1) as f64;
                for (g, cat) in categories.iter().enumerate() {
                    let gx = LEFT + g as f64 * gw;
                    let _ = write!(
                        s,
                        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                        gx + gw / 2.0,
                        TOP + ph + 16.0,
                        esc(cat)
                    );
                    for (i, (_, vals)) in series.iter().enumerate() {
                        let v = vals.get(g).copied().unwrap_or(f64::NAN);
                        if !v.is_finite() {
                            continue;
                        }
                        let (y0, y1) = (yp(0.0), yp(v));
                        let _ = write!(
                            s,
                            r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                            gx + gw * 0.1 + i as f64 * bw,
                            y0.min(y1),
                            bw,
                            (y0 - y1).abs(),
                            COLORS[i % COLORS.len()]
                        );
                    }
                }
            }
        }
        let _ = write!(
            s,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        for (i, name) in names.iter().enumerate() {
            let y = TOP + 10.0 + i as f64 * 18.0;
            let x = W - RIGHT + 12.0;
            let _ = write!(
                s,
                r#"<rect x="{x}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{}" y="{:.1}">{}</text>"#,
                y - 10.0,
                COLORS[i % COLORS.len()],
                x + 18.0,
                y,
                esc(name)
            );
        }
        s.push_str("</svg>\n");
        s
    }

    /// Writes `<dir>/<file>.svg` and returns its path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        let stem: String = self
            .file
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = dir.join(format!("{stem}.svg"));
        std::fs::write(&path, self.svg())
            .with_context(|| format!("cannot write plot {}", path.display()))?;
        Ok(path)
    }
}

/// Axis labels for power-of-two byte sizes (1k, 64k, 2M).
fn fmt_bytes_tick(v: f64) -> String {
    let b = v.round() as u64;
    if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
        format!("{}G", b >> 30)
    } else if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}k", b >> 10)
    } else {
        b.to_string()
    }
}

/// A progress bar on stderr for `len` steps (hidden when stderr is not a terminal).
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:<28} [{bar:32}] {pos}/{len} {elapsed_precise} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_and_quotes_csv() {
        let mut t = Table::new("demo", &["case", "GB/s"]);
        t.row(["unix, 1 client", "9.25"]);
        t.row(["tcp", "12.5"]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "demo");
        assert_eq!(lines[1], "case            GB/s");
        assert_eq!(lines[3], "unix, 1 client  9.25");
        assert_eq!(lines[4], "tcp             12.5");
        let csv = t.csv();
        assert_eq!(
            csv,
            "# demo\ncase,GB/s\n\"unix, 1 client\",9.25\ntcp,12.5\n"
        );
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.0, 0.37);
        assert!(t.len() >= 4 && t.len() <= 9, "{t:?}");
        assert_eq!(fmt_bytes_tick(65536.0), "64k");
        assert_eq!(fmt_bytes_tick(2097152.0), "2M");
    }

    #[test]
    fn svg_has_every_series_and_escapes_text() {
        let p = Plot {
            file: "a/b".into(),
            title: "x < y & z".into(),
            x_label: "block size".into(),
            y_label: "GB/s".into(),
            kind: PlotKind::Lines {
                series: vec![
                    Series {
                        name: "memcpy".into(),
                        points: vec![(4096.0, 1.0), (65536.0, 8.0)],
                    },
                    Series {
                        name: "kvtier".into(),
                        points: vec![(4096.0, 0.5), (65536.0, f64::NAN)],
                    },
                ],
                log_x: true,
            },
        };
        let svg = p.svg();
        assert!(svg.contains("x &lt; y &amp; z"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">memcpy<") && svg.contains(">kvtier<"));
        assert!(!svg.contains("NaN"));
        let dir = tempfile::tempdir().unwrap();
        let path = p.write(dir.path()).unwrap();
        assert_eq!(path.file_name().unwrap(), "a_b.svg");
        let bars = Plot {
            file: "bars".into(),
            title: "hit rate".into(),
            x_label: "capacity".into(),
            y_label: "%".into(),
            kind: PlotKind::Bars {
                categories: vec!["1M".into(), "3M".into()],
                series: vec![("lru".into(), vec![5.0, 13.0]), ("opt".into(), vec![9.0])],
            },
        };
        assert_eq!(bars.svg().matches("<rect x=").count(), 1 + 3 + 2);
    }
}
