//! Reports: one or more JSON results (from `bench throughput`, `latency` or `serve`) become a
//! Markdown table and an SVG chart with up to three panels: throughput by backend, latency
//! percentiles, and KV usage over time against the reserve-per-request baselines.

use super::latency::LatencyResult;
use super::serve::ServeResult;
use super::throughput::ThroughputResult;
use super::workload::Workload;
use anyhow::{Context, Result, bail};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// One results file, its rows parsed by kind.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub source: String,
    pub kind: String,
    pub model: String,
    pub workload: Option<Workload>,
    pub throughput: Vec<ThroughputResult>,
    pub latency: Vec<LatencyResult>,
    pub serve: Vec<ServeResult>,
}

pub fn load(path: &Path) -> Result<Loaded> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    parse(&path.display().to_string(), &v)
}

/// Parses a results document (as `bench` writes it).
pub fn parse(source: &str, v: &Value) -> Result<Loaded> {
    let kind = v["kind"].as_str().unwrap_or_default().to_string();
    let rows = v["results"].as_array().cloned().unwrap_or_default();
    let mut l = Loaded {
        source: source.to_string(),
        kind: kind.clone(),
        model: v["model"].as_str().unwrap_or_default().to_string(),
        workload: serde_json::from_value(v["workload"].clone()).ok(),
        ..Default::default()
    };
    let bad = |e: serde_json::Error| anyhow::anyhow!("{source}: a {kind} result is malformed: {e}");
    for r in rows {
        match kind.as_str() {
            "throughput" => l.throughput.push(serde_json::from_value(r).map_err(bad)?),
            "latency" => l.latency.push(serde_json::from_value(r).map_err(bad)?),
            "serve" => l.serve.push(serde_json::from_value(r).map_err(bad)?),
            k => bail!("{source}: unknown result kind '{k}' (throughput, latency or serve)"),
        }
    }
    Ok(l)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

/// Continuous over static output tokens/s, per backend that has both in `rows`.
pub fn scheduling_ratios(rows: &[&ThroughputResult]) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for c in rows.iter().filter(|r| r.scheduling == "continuous") {
        if let Some(s) = rows
            .iter()
            .find(|r| r.scheduling == "static" && r.backend == c.backend)
            && s.output_tokens_per_s > 0.0
        {
            out.push((
                c.backend.clone(),
                c.output_tokens_per_s / s.output_tokens_per_s,
            ));
        }
    }
    out
}

/// The Markdown report; `chart` is the SVG's path as the Markdown should link it.
pub fn markdown(files: &[Loaded], chart: Option<&str>) -> String {
    let mut md = String::new();
    let tp: Vec<(&Loaded, &ThroughputResult)> = files
        .iter()
        .flat_map(|f| f.throughput.iter().map(move |r| (f, r)))
        .collect();
    if !tp.is_empty() {
        md.push_str("### Throughput\n\n");
        md.push_str("| backend | scheduling | model | workload | requests | req/s | output tok/s | total tok/s | step p50 / p99 ms | KV utilization mean / peak | reserve-per-request: max_model_len / prompt+max_tokens | preemptions |\n");
        md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (f, r) in &tp {
            let wl = f
                .workload
                .as_ref()
                .map(|w| format!("{} (seed {})", workload_tag(w), w.seed))
                .unwrap_or_default();
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {}{} | {:.2} | {:.1} | {:.1} | {:.1} / {:.1} | {} / {} | {} / {} | {} |",
                r.backend,
                r.scheduling,
                f.model,
                wl,
                r.completed,
                if r.interrupted { " (interrupted)" } else { "" },
                r.requests_per_s,
                r.output_tokens_per_s,
                r.total_tokens_per_s,
                r.step_time_ms.p50,
                r.step_time_ms.p99,
                pct(r.kv_utilization_mean),
                pct(r.kv_utilization_peak),
                pct(r.reserve_baseline_kv_utilization),
                pct(r.reserve_max_tokens_kv_utilization),
                r.preemptions
            );
        }
        md.push('\n');
        // NOTE: ratios pair rows of one file: one workload, run back to back.
        for f in files {
            let rows: Vec<&ThroughputResult> = f.throughput.iter().collect();
            let tag = f.workload.as_ref().map(workload_tag).unwrap_or_default();
            for (backend, ratio) in scheduling_ratios(&rows) {
                let who = if tag.is_empty() {
                    backend
                } else {
                    format!("{backend}, {tag}")
                };
                let _ = writeln!(
                    md,
                    "- {who}: continuous batching gives **{ratio:.2}×** the output tokens/s of static batching."
                );
            }
        }
        let rows: Vec<&ThroughputResult> = tp.iter().map(|(_, r)| *r).collect();
        for r in &rows {
            let _ = writeln!(
                md,
                "- {} / {}: KV slots allocated at the peak: {} ({} tokens); an engine reserving max_model_len ({}) per request would have reserved {}, one reserving prompt + max_tokens {}.",
                r.backend,
                r.scheduling,
                mib(r.kv_peak_bytes),
                r.kv_peak_tokens,
                r.max_model_len,
                mib(r.reserve_baseline_peak_bytes),
                mib(r.reserve_max_tokens_peak_bytes)
            );
        }
        md.push('\n');
    }
    let lat: Vec<&LatencyResult> = files.iter().flat_map(|f| &f.latency).collect();
    if !lat.is_empty() {
        md.push_str("### Latency\n\n");
        md.push_str("| backend | batch | input / output | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | end-to-end p50 / p99 ms | output tok/s |\n");
        md.push_str("|---|---|---|---|---|---|---|\n");
        for r in &lat {
            let _ = writeln!(
                md,
                "| {} | {} | {} / {} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.0} / {:.0} | {:.1} |",
                r.backend,
                r.batch_size,
                r.input_len,
                r.output_len,
                r.ttft_ms.p50,
                r.ttft_ms.p90,
                r.ttft_ms.p99,
                r.tpot_ms.p50,
                r.tpot_ms.p90,
                r.tpot_ms.p99,
                r.e2e_ms.p50,
                r.e2e_ms.p99,
                r.output_tokens_per_s
            );
        }
        md.push('\n');
    }
    let sv: Vec<&ServeResult> = files.iter().flat_map(|f| &f.serve).collect();
    if !sv.is_empty() {
        md.push_str("### Serving\n\n");
        md.push_str("| server | model | load | completed / failed | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | end-to-end p50 / p99 ms |\n");
        md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &sv {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} / {} | {:.2} | {:.1} | {:.0} / {:.0} | {:.1} / {:.1} | {:.1} / {:.1} | {:.0} / {:.0} |",
                r.backend,
                r.model,
                load_label(r),
                r.completed,
                r.failed,
                r.requests_per_s,
                r.output_tokens_per_s,
                r.ttft_ms.p50,
                r.ttft_ms.p99,
                r.tpot_ms.p50,
                r.tpot_ms.p99,
                r.itl_ms.p50,
                r.itl_ms.p99,
                r.e2e_ms.p50,
                r.e2e_ms.p99
            );
        }
        md.push('\n');
    }
    if let Some(c) = chart {
        let _ = writeln!(md, "![benchmark chart]({c})\n");
    }
    md
}

/// `sharegpt 100/64`: the workload's kind and its prompt and output lengths.
fn workload_tag(w: &Workload) -> String {
    format!("{} {}/{}", w.kind.name(), w.input_len, w.output_len)
}

fn load_label(r: &ServeResult) -> String {
    let rate = r
        .request_rate
        .map(|x| format!("{x} req/s"))
        .unwrap_or_else(|| "all at once".into());
    match r.max_concurrency {
        Some(c) => format!("{rate}, concurrency {c}"),
        None => rate,
    }
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type KvField = fn(&super::throughput::KvSample) -> f64;

/// The SVG chart. Errors when there is nothing to draw.
pub fn svg(files: &[Loaded]) -> Result<String> {
    let mut bars: Vec<(String, f64)> = Vec::new();
    for f in files {
        for r in &f.throughput {
            bars.push((
                format!("{} / {}", r.backend, r.scheduling),
                r.output_tokens_per_s,
            ));
        }
        for r in &f.serve {
            bars.push((format!("{} (serve)", r.backend), r.output_tokens_per_s));
        }
    }
    // latency groups: (label, [TTFT p50, p90, p99, TPOT p50, p90, p99] in ms)
    let mut lat: Vec<(String, [f64; 6])> = Vec::new();
    for f in files {
        for r in &f.latency {
            lat.push((
                format!("{} b={}", r.backend, r.batch_size),
                [
                    r.ttft_ms.p50,
                    r.ttft_ms.p90,
                    r.ttft_ms.p99,
                    r.tpot_ms.p50,
                    r.tpot_ms.p90,
                    r.tpot_ms.p99,
                ],
            ));
        }
        for r in &f.serve {
            lat.push((
                format!("{} (serve)", r.backend),
                [
                    r.ttft_ms.p50,
                    r.ttft_ms.p90,
                    r.ttft_ms.p99,
                    r.tpot_ms.p50,
                    r.tpot_ms.p90,
                    r.tpot_ms.p99,
                ],
            ));
        }
    }
    let timelines: Vec<&ThroughputResult> = files
        .iter()
        .flat_map(|f| &f.throughput)
        .filter(|r| !r.kv_timeline.is_empty())
        .collect();
    let panels = usize::from(!bars.is_empty())
        + usize::from(!lat.is_empty())
        + usize::from(!timelines.is_empty());
    if panels == 0 {
        bail!("the results hold nothing to chart");
    }
    let (w, h) = (1100u32, 420u32);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (w, h * panels as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let areas = root.split_evenly((panels, 1));
        let mut next = areas.iter();
        if !bars.is_empty() {
            throughput_panel(next.next().unwrap(), &bars)?;
        }
        if !lat.is_empty() {
            latency_panel(next.next().unwrap(), &lat)?;
        }
        if !timelines.is_empty() {
            kv_panel(next.next().unwrap(), &timelines)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(out)
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart failed: {e:?}")
}

fn throughput_panel(area: &Area, bars: &[(String, f64)]) -> Result<()> {
    let ymax = bars.iter().map(|b| b.1).fold(0.0, f64::max).max(1e-9) * 1.15;
    let n = bars.len();
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Throughput by backend (output tokens/s)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        // NOTE: integer ranges are inclusive as segments: 0..n-1 gives n of them.
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..ymax)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) if *i < n => bars[*i].0.clone(),
            _ => String::new(),
        })
        .y_desc("output tokens/s")
        .draw()
        .map_err(plot_err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let mut r = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), *v),
                ],
                COLORS[i % COLORS.len()].mix(0.8).filled(),
            );
            r.set_margin(0, 0, 25, 25);
            r
        }))
        .map_err(plot_err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let style = ("sans-serif", 15)
                .into_font()
                .into_text_style(area)
                .pos(Pos::new(HPos::Center, VPos::Bottom));
            Text::new(format!("{v:.1}"), (SegmentValue::CenterOf(i), *v), style)
        }))
        .map_err(plot_err)?;
    Ok(())
}

const LAT_SERIES: [&str; 6] = [
    "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99",
];

fn latency_panel(area: &Area, groups: &[(String, [f64; 6])]) -> Result<()> {
    // Each group is 7 segments: 6 bars and a gap. Log scale: TTFT and TPOT differ by orders
    // of magnitude.
    let seg = 7;
    let n = groups.len() * seg;
    let vals = groups.iter().flat_map(|g| g.1).filter(|v| *v > 0.0);
    let ymax = vals.clone().fold(1.0, f64::max) * 2.0;
    let ymin = (vals.fold(f64::INFINITY, f64::min) / 2.0).clamp(0.01, 1.0);
    let mut chart = ChartBuilder::on(area)
        .caption("Latency percentiles (ms, log scale)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((0..n - 1).into_segmented(), (ymin..ymax).log_scale())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) if i % seg == 2 && i / seg < groups.len() => {
                groups[i / seg].0.clone()
            }
            _ => String::new(),
        })
        .y_desc("milliseconds")
        .draw()
        .map_err(plot_err)?;
    for (m, name) in LAT_SERIES.iter().enumerate() {
        let color = COLORS[m % COLORS.len()];
        chart
            .draw_series(groups.iter().enumerate().map(move |(g, (_, v))| {
                let k = g * seg + m;
                Rectangle::new(
                    [
                        (SegmentValue::Exact(k), ymin),
                        (SegmentValue::Exact(k + 1), v[m].max(ymin)),
                    ],
                    color.mix(0.8).filled(),
                )
            }))
            .map_err(plot_err)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

fn kv_panel(area: &Area, rows: &[&ThroughputResult]) -> Result<()> {
    let tmax = rows
        .iter()
        .filter_map(|r| r.kv_timeline.last())
        .map(|s| s.t_s)
        .fold(1e-9, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "KV usage over time: Pagoda against reserve-per-request engines",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..tmax, 0.0..102.0)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("% of KV memory holding tokens")
        .draw()
        .map_err(plot_err)?;
    for (i, r) in rows.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let name = format!("{} / {}", r.backend, r.scheduling);
        let series: [(String, KvField, u32); 3] = [
            (format!("{name}: Pagoda (paged)"), |s| s.kv_utilization, 2),
            (
                format!("{name}: reserving prompt+max_tokens"),
                |s| s.reserve_max_tokens_utilization,
                1,
            ),
            (
                format!("{name}: reserving max_model_len"),
                |s| s.reserve_baseline_utilization,
                1,
            ),
        ];
        for (k, (label, f, width)) in series.into_iter().enumerate() {
            let style = ShapeStyle {
                color: color.mix(1.0 - 0.3 * k as f64),
                filled: false,
                stroke_width: width,
            };
            let pts = r
                .kv_timeline
                .iter()
                .filter(|s| s.running > 0)
                .map(move |s| (s.t_s, f(s) * 100.0));
            let drawn = if k == 0 {
                chart.draw_series(LineSeries::new(pts, style))
            } else {
                chart.draw_series(DashedLineSeries::new(pts, 3 + 3 * k as u32, 4, style))
            };
            drawn
                .map_err(plot_err)?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    // NOTE: the legend goes where there is least data: Pagoda's lines run high, the baselines
    // that reserve max_model_len hug zero.
    let (pw, ph) = chart.plotting_area().dim_in_pixel();
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::Coordinate(
            pw as i32 - 430,
            (ph as f64 * 0.42) as i32,
        ))
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::stats::Summary;
    use crate::bench::throughput::KvSample;
    use serde_json::json;

    fn tp(backend: &str, scheduling: &str, tps: f64) -> ThroughputResult {
        let timeline = (0..50)
            .map(|i| KvSample {
                t_s: i as f64 * 0.1,
                kv_utilization: 0.95,
                kv_blocks_used: 0.2,
                reserve_baseline_utilization: 0.02,
                reserve_max_tokens_utilization: 0.5,
                running: 4,
                waiting: 0,
            })
            .collect();
        ThroughputResult {
            backend: backend.into(),
            backend_detail: format!("{backend} device"),
            scheduling: scheduling.into(),
            num_requests: 10,
            completed: 10,
            duration_s: 5.0,
            requests_per_s: 2.0,
            output_tokens_per_s: tps,
            total_tokens_per_s: tps * 2.0,
            prompt_tokens: 100,
            output_tokens: 100,
            steps: 50,
            step_time_ms: Summary::of(&[10.0, 20.0]),
            kv_utilization_mean: 0.95,
            kv_utilization_peak: 0.99,
            kv_blocks_used_mean: 0.2,
            kv_blocks_used_peak: 0.3,
            kv_peak_tokens: 320,
            kv_peak_bytes: 320 << 10,
            kv_capacity_tokens: 10_000,
            max_model_len: 2048,
            reserve_baseline_kv_utilization: 0.02,
            reserve_baseline_peak_tokens: 20480,
            reserve_baseline_peak_bytes: 20480 << 10,
            reserve_max_tokens_kv_utilization: 0.5,
            reserve_max_tokens_peak_tokens: 600,
            reserve_max_tokens_peak_bytes: 600 << 10,
            preemptions: 0,
            prefix_caching: true,
            n: 1,
            n_mode: "group".into(),
            preemption_mode: "recompute".into(),
            swap_bytes: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            prefix_cache_hit_rate: 0.0,
            spec_draft_tokens: 0,
            spec_accepted_tokens: 0,
            ttft_ms: Summary::of(&[100.0]),
            kv_peak_blocks: 20,
            structured: "none".into(),
            tpot_ms: Summary::of(&[10.0]),
            temperature: 0.0,
            top_p: 1.0,
            random_samples_on_device: 0,
            interrupted: false,
            kv_timeline: timeline,
            requests: vec![],
        }
    }

    fn files() -> Vec<Loaded> {
        let throughput = json!({
            "kind": "throughput", "model": "tiny",
            "results": [tp("cpu", "continuous", 120.0), tp("cpu", "static", 48.0), tp("wgpu", "continuous", 900.0)],
        });
        let latency = LatencyResult {
            backend: "cuda".into(),
            backend_detail: "cuda:0".into(),
            batch_size: 8,
            input_len: 32,
            output_len: 16,
            iterations: 3,
            ttft_ms: Summary::of(&[50.0, 60.0, 70.0]),
            tpot_ms: Summary::of(&[5.0, 6.0, 7.0]),
            e2e_ms: Summary::of(&[150.0, 160.0]),
            batch_latency_ms: Summary::of(&[160.0]),
            output_tokens_per_s: 800.0,
            interrupted: false,
        };
        let latency = json!({"kind": "latency", "model": "tiny", "results": [latency]});
        vec![
            parse("a.json", &throughput).unwrap(),
            parse("b.json", &latency).unwrap(),
        ]
    }

    #[test]
    fn the_svg_is_produced_and_names_each_backend() {
        let svg = svg(&files()).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for name in [
            "cpu / continuous",
            "cpu / static",
            "wgpu / continuous",
            "cuda b=8",
        ] {
            assert!(svg.contains(name), "the chart does not name {name}");
        }
        for caption in [
            "Throughput by backend",
            "Latency percentiles",
            "KV usage over time",
        ] {
            assert!(svg.contains(caption), "no panel '{caption}'");
        }
        assert!(svg.contains("<rect") && svg.contains("<polyline"));
    }

    #[test]
    fn markdown_has_a_row_per_result_and_the_ratio() {
        let md = markdown(&files(), Some("chart.svg"));
        assert_eq!(md.lines().filter(|l| l.starts_with("| cpu |")).count(), 2);
        assert!(md.contains("| wgpu | continuous |"));
        assert!(md.contains("| cuda | 8 |"));
        assert!(md.contains("**2.50×**"), "{md}");
        // a second file on another workload: its ratio pairs its own rows
        let mut more = files();
        let other = json!({
            "kind": "throughput", "model": "tiny",
            "workload": crate::bench::workload::Workload::new(
                crate::bench::workload::WorkloadKind::Fixed, 10, Some(8), Some(4), 1),
            "results": [tp("cpu", "static", 100.0), tp("cpu", "continuous", 150.0)],
        });
        more.push(parse("c.json", &other).unwrap());
        assert!(md.contains("95.0% / 99.0%") && md.contains("2.0% / 50.0%"));
        assert!(md.contains("![benchmark chart](chart.svg)"));
        let md2 = markdown(&more, None);
        assert!(
            md2.contains("- cpu: continuous batching gives **2.50×**"),
            "{md2}"
        );
        assert!(
            md2.contains("- cpu, fixed 8/4: continuous batching gives **1.50×**"),
            "{md2}"
        );
    }

    #[test]
    fn nothing_to_chart_and_unknown_kinds_are_errors() {
        let empty = parse("e.json", &json!({"kind": "serve", "results": []})).unwrap();
        assert!(svg(&[empty]).is_err());
        assert!(parse("x.json", &json!({"kind": "nope", "results": [{}]})).is_err());
        assert!(
            parse(
                "y.json",
                &json!({"kind": "latency", "results": [{"backend": 1}]})
            )
            .is_err()
        );
    }
}
