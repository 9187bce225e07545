//! The simulation's plot, as SVG written by hand: on the left the CDF of the time to ready of
//! each scenario, on the right the bytes by level (origin, across racks, within racks) of each,
//! in units of the model.

use std::fmt::Write;

use super::Outcome;

const COLOURS: [&str; 4] = ["#d62728", "#1f77b4", "#ff7f0e", "#2ca02c"];
const W: f64 = 960.0;
const H: f64 = 470.0;
/// The CDF's frame: left, top, width, height.
const CDF: (f64, f64, f64, f64) = (60.0, 40.0, 520.0, 320.0);
/// The bars' frame.
const BARS: (f64, f64, f64, f64) = (660.0, 40.0, 260.0, 320.0);

/// The plot of `outcomes` for a model of `size` bytes.
pub(super) fn plot(outcomes: &[Outcome], size: f64) -> String {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    cdf(&mut svg, outcomes);
    bars(&mut svg, outcomes, size);
    svg.push_str("</svg>\n");
    svg
}

/// Axis lines, a title and the labels of both ends of each axis.
fn frame(svg: &mut String, (x, y, w, h): (f64, f64, f64, f64), title: &str, x_end: &str, y_end: &str) {
    let _ = writeln!(
        svg,
        r#"<path d="M{x} {y} V{b} H{r}" stroke="black" fill="none"/><text x="{x}" y="{t}" font-weight="bold">{title}</text><text x="{r}" y="{lb}" text-anchor="end">{x_end}</text><text x="{l}" y="{ty}" text-anchor="end">{y_end}</text><text x="{l}" y="{b}" text-anchor="end">0</text>"#,
        b = y + h,
        r = x + w,
        t = y - 14.0,
        lb = y + h + 16.0,
        l = x - 6.0,
        ty = y + 10.0,
    );
}

fn cdf(svg: &mut String, outcomes: &[Outcome]) {
    let (x, y, w, h) = CDF;
    let last = outcomes
        .iter()
        .filter_map(|o| o.ready.last().copied())
        .filter(|t| t.is_finite())
        .fold(0.0, f64::max)
        .max(1e-9);
    frame(
        svg,
        CDF,
        "Nodes ready (share) against time (s)",
        &format!("{last:.0} s"),
        "1",
    );
    for (i, o) in outcomes.iter().enumerate() {
        let n = o.ready.len().max(1) as f64;
        let mut d = format!("M{x} {}", y + h);
        for (k, t) in o.ready.iter().enumerate() {
            let px = x + t.min(last) / last * w;
            let py = y + h - (k as f64 + 1.0) / n * h;
            let _ = write!(d, " H{px:.1} V{py:.1}");
        }
        let colour = COLOURS[i % COLOURS.len()];
        let _ = writeln!(
            svg,
            r#"<path d="{d}" stroke="{colour}" fill="none" stroke-width="2"/>"#
        );
        let (lx, ly) = (x, y + h + 36.0 + 16.0 * i as f64);
        let _ = writeln!(
            svg,
            r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{colour}"/><text x="{}" y="{ly}">{}</text>"#,
            ly - 9.0,
            lx + 14.0,
            o.name
        );
    }
}

fn bars(svg: &mut String, outcomes: &[Outcome], size: f64) {
    let (x, y, w, h) = BARS;
    let most = outcomes
        .iter()
        .map(|o| (o.origin_bytes + o.spine_bytes + o.rack_bytes) / size)
        .fold(1.0, f64::max);
    frame(svg, BARS, "Bytes by level (÷ model)", "", &format!("{most:.0}"));
    let slot = w / outcomes.len().max(1) as f64;
    let levels = ["origin", "across racks", "within racks"];
    let shades = ["#555555", "#999999", "#cccccc"];
    for (i, o) in outcomes.iter().enumerate() {
        let mut top = y + h;
        for (level, bytes) in [o.origin_bytes, o.spine_bytes, o.rack_bytes]
            .into_iter()
            .enumerate()
        {
            let height = bytes / size / most * h;
            top -= height;
            let _ = writeln!(
                svg,
                r#"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{height:.1}" fill="{}"><title>{}: {:.2}</title></rect>"#,
                x + i as f64 * slot + slot * 0.15,
                slot * 0.7,
                shades[level],
                levels[level],
                bytes / size
            );
        }
        let _ = writeln!(
            svg,
            r#"<rect x="{:.1}" y="{}" width="{:.1}" height="4" fill="{}"/>"#,
            x + i as f64 * slot + slot * 0.15,
            y + h + 4.0,
            slot * 0.7,
            COLOURS[i % COLOURS.len()]
        );
    }
    for (level, name) in levels.iter().enumerate() {
        let ly = y + h + 36.0 + 16.0 * level as f64;
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{ly}">{name}</text>"#,
            ly - 9.0,
            shades[level],
            x + 14.0
        );
    }
}
